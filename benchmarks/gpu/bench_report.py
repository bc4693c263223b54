"""gpu_bench's results: per-budget records, ratios, the markdown tables, writing them to $OUT."""

from __future__ import annotations

import json
from pathlib import Path

from bench_processes import ALL_ARMS, BUDGETS

# --- report -------------------------------------------------------------------------------------------------------


def arms_at(results: dict, budget: str) -> dict:
    """The arms' records at one budget."""
    return results["budgets"].setdefault(budget, {"arms": {}, "ratios": {}})["arms"]


def record_failure(results: dict, arm: str, budgets: list[str], error: str) -> None:
    """arm stopped with error at the first budget that has no record of it; the later budgets were never run."""
    missing = [b for b in budgets if arm not in arms_at(results, b)]
    for k, budget in enumerate(missing):
        arms_at(results, budget)[arm] = {"error": error[:3000] if k == 0 else
                                         f"not run: the arm stopped at budget {missing[0]}"}


def serve_variant(api_servers: int, conc: int, ks: list[int], concs: list[int]) -> str:
    """The arm name of one `vllm serve` setting: `serve` when only one was tried, else what varied (serve-k8,
    serve-c1024, serve-k8-c1024)."""
    parts = ([f"k{api_servers}"] if len(ks) > 1 else []) + ([f"c{conc}"] if len(concs) > 1 else [])
    return "-".join(["serve", *parts])


def best_serve(results: dict, variants: list[str]) -> None:
    """At each budget, the fastest of the serve variants' records (serve_variant's names) becomes the serve arm (the
    ratios' `vllm serve`), with every variant's rate beside it."""
    for section in results["budgets"].values():
        arms = section["arms"]
        tried = {name: arms.get(name) for name in variants}
        rates = {name: r["img_per_s"] for name, r in tried.items() if isinstance(r, dict) and r.get("img_per_s")}
        if rates:
            best = max(rates, key=rates.get)
            arms["serve"] = dict(tried[best], best_of={name[len("serve-"):]: v for name, v in rates.items()})


def ratios(arms: dict) -> dict:
    def rate(name: str, figure: str = "img_per_s") -> float | None:
        r = arms.get(name, {})
        return r.get(figure) if isinstance(r, dict) and not r.get("error") else None

    out = {}
    for p in ("pipeline-embeds", "pipeline-pixels"):
        for other in ("naive", "serve", "ceiling-preresized", "ceiling-embeds"):
            a, b = rate(p), rate(other)
            if a and b:
                out[f"{p} / {other}"] = round(a / b, 2)
        # Both sides between their first and last windows: a whole phase counts each side's fill at its start, and
        # the pipeline keeps far more images in flight (twice the engine's batch) than serve's client (--serve-conc).
        a, b = rate(p, "steady_img_per_s"), rate("serve", "steady_img_per_s")
        if a and b:
            out[f"{p} / serve, steady"] = round(a / b, 2)
    a, b = rate("pipeline-embeds"), rate("pipeline-embeds-public")
    if a and b:  # the tower in vLLM's engine process (the hooks) against the tower here (the public path)
        out["pipeline-embeds / pipeline-embeds-public"] = round(a / b, 2)
    a, b = rate("ceiling-preresized"), rate("naive")
    if a and b:
        out["ceiling-preresized / naive"] = round(a / b, 2)
    a, b = rate("serve"), rate("naive")
    if a and b:
        out["serve / naive"] = round(a / b, 2)
    return out


def cpu_ms_per_image(record: dict) -> float | None:
    """CPU milliseconds an arm's processes spent per image described (front end, decode, engine process): what its
    throughput costs in cores, whatever the GPU does."""
    cores, rate = record.get("cpu_cores"), record.get("img_per_s")
    return round(cores / rate * 1000, 1) if cores is not None and rate else None


def markdown(results: dict) -> str:
    """One table (and one ratio table) per budget."""
    c = results["config"]
    lines: list[str] = []
    for budget, section in results["budgets"].items():
        if lines:
            lines.append("")
        lines += [f"## gpu_bench: budget {budget} ({BUDGETS[budget]} px), {c['max_tokens']} output tokens "
                  f"(ignore_eos), {c['seconds']} s per arm, {c.get('gpu_name') or '?'}",
                  "", "| arm | img/s | first window | last window | GPU busy | decode cores | CPU cores, all | "
                  "CPU ms per image | n | note |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for name in [*ALL_ARMS, *sorted(set(section["arms"]) - set(ALL_ARMS))]:
            r = section["arms"].get(name)
            if r is None:
                continue
            if r.get("error"):
                last = [ln.strip(" │|'\")") for ln in r["error"].replace("\\n", "\n").splitlines()
                        if len(ln.strip(" │|'\")")) > 3]
                named = [ln for ln in last if "rror" in ln or "imeout" in ln or "exited" in ln or "not run" in ln]
                lines.append(f"| {name} | failed | | | | | | | | "
                             f"{(named or last or ['?'])[-1][:160].replace('|', '/')} |")
                continue
            note = []
            if name.startswith("pipeline"):
                note.append(f"phase {r.get('phase')}, {r.get('decode_workers')} decode workers, {r.get('gpus')} GPU(s), "
                            f"{'complete' if r.get('complete') else 'INCOMPLETE'}, dead letters {r.get('dead_letters')}, "
                            f"warm-up {r.get('warmup_s')} s")
                if r.get("tower_tflops_in_engine"):
                    note.append(f"tower {r['tower_tflops_in_engine']} TFLOPS by "
                                f"{r.get('tower_timed_by', 'its time in the engine')} "
                                f"({r['tower_gflop_per_image']} GFLOP per image)")
                if r.get("other_phase_records"):
                    note.append(f"{r['other_phase_records']} records of other phases in the window")
                if r.get("prefix_caching"):
                    note.append("prefix caching on")
                if r.get("max_num_seqs") not in (None, "vLLM default"):
                    note.append(f"max_num_seqs {r['max_num_seqs']}, max_num_batched_tokens "
                                f"{r.get('max_num_batched_tokens')}")
            if name.startswith("serve"):
                note.append(f"--api-server-count {r.get('api_servers')}, {r.get('procs')} client procs, "
                            f"conc {r.get('conc')}")
                if r.get("best_of"):
                    note.append("fastest of " + ", ".join(f"{k} {v}" for k, v in r["best_of"].items()))
            if r.get("steady_img_per_s"):
                note.append(f"steady {r['steady_img_per_s']} img/s between the first and last windows")
            if "mean_prompt_tokens" in r:
                note.append(f"prompt {r['mean_prompt_tokens']} tok")
            cells = [r.get("img_per_s"), r.get("first_window_img_per_s"), r.get("last_window_img_per_s"),
                     r.get("gpu_busy"), r.get("decode_cores"), r.get("cpu_cores"), cpu_ms_per_image(r),
                     r.get("n", r.get("described", r.get("ok")))]
            lines.append(f"| {name} | " + " | ".join("" if v is None else str(v) for v in cells)
                         + f" | {'; '.join(note)} |")
        if section.get("ratios"):
            lines += ["", "| ratio | value |", "|---|---|"] + [f"| {k} | {v} |" for k, v in section["ratios"].items()]
    if results.get("runner_stats"):
        lines += ["", "Inference runners' own account (all phases of the arm, warm-ups and the gaps between them "
                  "included): engine idle = nothing submitted to it after the first record (input ran dry); idle with "
                  "work waiting = idle while the runner held fetched records (the runner starving it).", "",
                  "| arm | runners | span s (each) | engine idle | idle with work waiting | visual tokens/s (all) | described |",
                  "|---|---|---|---|---|---|---|"]
        for arm, st in results["runner_stats"].items():
            lines.append(f"| {arm} | {st.get('runners')} | {st.get('span_s')} | {st.get('engine_idle_fraction')} | "
                         f"{st.get('idle_with_work_fraction')} | {st.get('visual_tokens_per_s')} | "
                         f"{st.get('described')} |")
    return "\n".join(lines) + "\n"


def save(results: dict, out: Path) -> None:
    for section in results["budgets"].values():
        section["ratios"] = ratios(section["arms"])
    (out / "gpu_bench.json").write_text(json.dumps(results, indent=1))
    (out / "gpu_bench.md").write_text(markdown(results))
