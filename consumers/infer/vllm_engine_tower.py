"""The inference consumer's side of our vision tower in vLLM's engine process (engine_tower.py runs there).

Where embeds mode runs the tower (``_set_tower_place``): in vLLM's engine process, which gets our worker extension
and what this process decided for it (``EngineTowerConfig``, engine_boundary.py) when it starts, or in this
process (vllm_encoder_thread.py). With the tower there, this side asks the worker what it runs
(``_engine_tower_problem``: a model that does not take the tower sends it back here), reads its clock for the
results' timings, and takes the embeddings the engine keeps for this process (``EngineEmbeddings``), all through
vLLM's public ``collective_rpc``.
"""

from __future__ import annotations

import asyncio
import logging

import numpy as np

from consumers.infer.engine_boundary import EngineTowerConfig
from vlmstream import vllm_adapter

log = logging.getLogger(__name__)

# vLLM imports this class's module in its worker before it builds the model (engine_tower.py says why).
ENGINE_TOWER_EXTENSION = "consumers.infer.engine_tower.EngineTowerExtension"
ENGINE_TOWER_CLOCK_S = 10.0  # how often the consumer reads the engine tower's GPU time (a utility call between steps)


class EngineEmbeddings:
    """The embeddings vLLM's engine process keeps for the pixel rows' tags (engine_tower.EmbeddingTap), taken for
    every request that finished meanwhile in one utility call, not one call per image: the engine answers such calls
    between its steps. ``fetch(tags)`` is that call (``collective_rpc("vlmstream_take_embeddings")``)."""

    def __init__(self, fetch):
        self._fetch = fetch
        self._waiting: dict[int, asyncio.Future] = {}
        self._taking: asyncio.Task | None = None

    async def take(self, tag: int):
        """The float16 embedding kept under ``tag``, or None if the engine kept none."""
        future = asyncio.get_running_loop().create_future()
        self._waiting[tag] = future
        if self._taking is None or self._taking.done():
            self._taking = asyncio.ensure_future(self._take_waiting())
        return await future

    async def _take_waiting(self) -> None:
        # One call for every tag that waits, again for those that came while a call ran: no tag is left waiting.
        while self._waiting:
            waiting, self._waiting = self._waiting, {}
            try:
                found = await self._fetch(list(waiting))
            except Exception as exc:  # noqa: BLE001 - each waiting request fails with the call's error
                for future in waiting.values():
                    if not future.done():
                        future.set_exception(exc)
                continue
            for tag, future in waiting.items():
                if not future.done():
                    kept = found.get(tag)
                    future.set_result(None if kept is None else np.frombuffer(kept, dtype=np.float16))


class EngineTowerSide:
    """VllmEngine's part that deals with our tower in vLLM's engine process: where the tower runs, what the engine
    is started with for it, and what the consumer asks the engine's worker (``collective_rpc``)."""

    def _set_tower_place(self, in_engine: bool) -> None:
        """Where embeds mode runs our tower: in vLLM's engine process, shipping the decoded image there as pixel rows
        (consumers/infer/pixel_rows.py), or here, shipping image_embeds to vLLM."""
        self._tower_in_engine = in_engine
        # Then the engine also keeps each image's embedding, found by the tag its pixel rows carry.
        self._engine_embeddings = (EngineEmbeddings(self._take_engine_embeddings)
                                   if in_engine and self.settings.publish_embeddings else None)

    def _engine_tower_start(self) -> tuple[dict, dict[str, str]]:
        """The engine arguments and the engine process's environment for the tower's place: with the tower there,
        vLLM imports our extension's module in its worker, which installs the tower (engine_tower.py), configured by
        what this process decided (engine_boundary.py)."""
        if not self._tower_in_engine:
            return {}, {}
        # The release as the engine process reads it (the installed distribution's), so that the two compare alike.
        config = EngineTowerConfig.for_engine(self.model_path, self.family, self.settings,
                                              vllm_adapter.installed_vllm())
        return {"worker_extension_cls": ENGINE_TOWER_EXTENSION}, config.environment()

    def _engine_tower_problem(self) -> str | None:
        """Log what vLLM's worker says it runs (engine_tower.EngineTowerExtension); why the engine did not take it,
        or None."""
        try:
            report = self.tower_report(timeout_s=120)
        except Exception as exc:  # noqa: BLE001 - whatever went wrong, the engine did not take our tower
            report = {"installed": [], "error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        self.engine_tower_report = report
        log.info("vLLM's engine process, vlmstream's tower wrapper: %s", report)  # plan_x1.sh's readers look for it
        if not report.get("installed") or not report.get("model", {}).get("wrapped"):
            return f"the model vLLM {self._v.version} built does not take vlmstream's tower wrapper ({report})"
        if not report.get("encoders"):
            log.warning("vLLM ran no image at start, so the tower in its engine process is built (and compiled) on "
                        "the first batch")
        return None

    def _embeds_here(self) -> bool:
        """Whether this process makes the image_embeds vLLM gets (embeds mode, tower not in vLLM's engine)."""
        return self.mode == "embeds" and not self._tower_in_engine

    async def _tower_report(self) -> dict:
        """What the wrapper in vLLM's worker reports (engine_tower.EngineTowerExtension): one worker, one GPU."""
        return (await self.llm.collective_rpc("vlmstream_tower_report"))[0]

    def tower_report(self, timeout_s: float = 10) -> dict:
        """What vLLM's worker reports now (engine_tower.EngineTowerExtension): the tower it runs, its clock and the
        embeddings it keeps."""
        return self._engine_loop.call(self._tower_report(), timeout_s)

    async def _take_engine_embeddings(self, tags: list[int]) -> dict[int, bytes]:
        return (await self.llm.collective_rpc("vlmstream_take_embeddings", args=(tags,)))[0]

    async def _watch_engine_tower(self) -> None:
        """Read the engine tower's clock (engine_tower.TowerClock) every ENGINE_TOWER_CLOCK_S: its GPU ms per image
        since the last reading becomes engine_tower_ms_per_image."""
        last = None
        while True:
            await asyncio.sleep(ENGINE_TOWER_CLOCK_S)
            try:
                clock = (await self._tower_report())["clock"]
            except Exception as exc:  # noqa: BLE001 - a clock that cannot be read only leaves the timing out
                log.warning("the engine tower's clock could not be read (%s: %s); its timings stay out of results",
                            type(exc).__name__, str(exc)[:200])
                return
            if last is not None and clock["images"] > last["images"]:
                self.engine_tower_ms_per_image = round(
                    (clock["gpu_ms"] - last["gpu_ms"]) / (clock["images"] - last["images"]), 2)
            last = clock

    def _log_engine_tower_clock(self) -> None:
        self._tower_watch.cancel()
        try:
            report = self.tower_report()
            clock = report["clock"]
        except Exception as exc:  # noqa: BLE001 - only a closing log line is lost
            # A stop by signal reaches vLLM's engine process too: it may be gone before this reading.
            log.warning("the engine tower's clock could not be read at close (%s: %s)", type(exc).__name__,
                        str(exc)[:200])
            return
        log.info("the vision tower in vLLM's engine process: %d images in %d forwards, %.1f GPU ms per image; "
                 "embeddings kept there for this process: %s", clock["images"], clock["forwards"],
                 clock["gpu_ms"] / max(1, clock["images"]), report.get("embeddings"))
