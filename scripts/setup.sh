#!/usr/bin/env bash
# Installs vlmstream into ./.venv (CPU: torch from PyPI runs fine without a GPU). Idempotent and quick
# the second time: pip reuses its cache, and nothing is reinstalled when pyproject.toml is unchanged.
set -euo pipefail
cd "$(dirname "$0")/.."

# libjpeg-turbo's TurboJPEG API for PyTurboJPEG (Debian/Ubuntu); without it decode falls back to Pillow.
if ! ldconfig -p 2>/dev/null | grep -q libturbojpeg.so; then
  if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    apt-get install -y -q libturbojpeg0 >/dev/null 2>&1 || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q libturbojpeg0 >/dev/null 2>&1; } \
      || echo "setup: could not install libturbojpeg0; JPEG decode will use Pillow" >&2
  else
    echo "setup: libturbojpeg not found; JPEG decode will use Pillow (install libturbojpeg0 for speed)" >&2
  fi
fi

# Headless Chromium and its driver for tests/test_view.py (selenium drives /usr/bin/chromedriver); without them that
# test skips and says why.
if [ ! -x /usr/bin/chromium ] || [ ! -x /usr/bin/chromedriver ]; then
  if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    apt-get install -y -q chromium chromium-driver >/dev/null 2>&1 || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q chromium chromium-driver >/dev/null 2>&1; } \
      || echo "setup: could not install chromium and chromium-driver; the browser test of vlmstream view will skip" >&2
  else
    echo "setup: chromium/chromedriver not found; the browser test of vlmstream view will skip (Debian: chromium chromium-driver)" >&2
  fi
fi

# poppler's pdftoppm for tests/test_pdf.py (the decode stage's PDF pages against pdftoppm and the processor) and
# benchmarks/bench_pdf_render.py; without it that test skips and says why.
if ! command -v pdftoppm >/dev/null; then
  if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    apt-get install -y -q poppler-utils >/dev/null 2>&1 || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q poppler-utils >/dev/null 2>&1; } \
      || echo "setup: could not install poppler-utils; the PDF test against pdftoppm will skip" >&2
  else
    echo "setup: pdftoppm not found; the PDF test against pdftoppm will skip (Debian: poppler-utils)" >&2
  fi
fi

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.vlmstream-installed
want=$(cat pyproject.toml constraints.txt | sha256sum | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -c constraints.txt -e '.[cpu,test]'
  echo "$want" > "$stamp"
fi
