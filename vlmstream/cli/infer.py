"""`vlmstream infer` (the GPU consumer: runner + engine + document-result aggregator) and `vlmstream tiny-model`."""

from typing import Optional

import typer


def infer(
    ctx: typer.Context,
    model: Optional[str] = typer.Option(None, "--model", help="HF id or local folder; default: the tiny model."),
    engine: Optional[str] = typer.Option(None, "--engine", help="auto, vllm or transformers."),
    mode: Optional[str] = typer.Option(None, "--mode", help="vLLM input: embeds or pixels."),
    prompt: Optional[str] = typer.Option(None, "--prompt"),
    prompt_id: Optional[str] = typer.Option(None, "--prompt-id"),
    output_schema: Optional[str] = typer.Option(None, "--output-schema", help="JSON Schema file for the output."),
    max_new_tokens: Optional[int] = typer.Option(None, "--max-new-tokens"),
    batch_size: Optional[int] = typer.Option(None, "--batch-size"),
    max_images_in_flight: Optional[int] = typer.Option(None, "--max-images-in-flight"),
    no_embeddings: bool = typer.Option(False, "--no-embeddings", help="Do not publish vision embeddings."),
    exactly_once: bool = typer.Option(False, "--exactly-once", help="Transactional outputs + offsets."),
    max_attempts: Optional[int] = typer.Option(None, "--max-attempts"),
    group_id: Optional[str] = typer.Option(None, "--group-id"),
    max_seconds: Optional[float] = typer.Option(None, "--max-seconds", help="Stop (draining) after this long."),
    until_idle_s: Optional[float] = typer.Option(None, "--until-idle-s", help="Stop when idle this long."),
    no_results: bool = typer.Option(False, "--no-results", help="Do not run the document-result aggregator."),
) -> None:
    """Consume image payloads, describe and embed them, publish descriptions/embeddings (and document results).

    SIGTERM/SIGINT: stop fetching, let the engine finish what it holds (up to 120 s), flush, commit, leave the group.
    The results aggregator then reads the last descriptions (up to 30 s), flushes and commits; exit 0.
    Each flush, commit and close waits at most kafka.request_timeout_ms (30 s), whether or not the cluster answers.
    Outputs the cluster did not acknowledge: no commit, one log line naming the bootstrap servers, exit status 4.
    A second signal stops at once (nothing more is committed).
    """
    import logging
    import os
    import threading

    from consumers.infer.factory import make_engine
    from consumers.infer.runner import InferenceRunner
    from consumers.results.aggregator import ResultsAggregator
    from vlmstream import profiling
    from vlmstream.cli.support import bootstrap, settings_from
    from vlmstream.stopping import Stop

    profiler = profiling.start_from_env()  # VLMSTREAM_PROFILE_OUT: where this process's CPU goes, per thread
    infer_overrides = {
        "model": model, "engine": engine, "mode": mode, "prompt": prompt, "prompt_id": prompt_id,
        "output_schema": output_schema, "max_new_tokens": max_new_tokens,
        "batch_size": batch_size, "max_images_in_flight": max_images_in_flight, "max_attempts": max_attempts,
        "group_id": group_id, "publish_embeddings": False if no_embeddings else None,
        "exactly_once": True if exactly_once else None,
    }
    settings = bootstrap(settings_from(ctx, {"infer": infer_overrides}))
    model_path = settings.infer.model
    if not model_path:
        from consumers.infer.tiny_model import default_tiny_model_dir

        model_path = str(default_tiny_model_dir())
    stop = Stop("vlmstream infer").install()
    aggregator, aggregator_thread, aggregator_stop = None, None, threading.Event()
    if not no_results:
        aggregator = ResultsAggregator(settings)
        aggregator_thread = aggregator.start_thread(aggregator_stop)
    engine_impl = make_engine(settings.infer, model_path)
    code = 1  # an exception out of the runner
    try:
        runner = InferenceRunner(settings, engine_impl)
        if settings.metrics_port > 0:
            from consumers.infer.metrics import serve

            from consumers.results.metrics import AggregatorCollector

            serve(runner, settings.metrics_port, *([AggregatorCollector(aggregator)] if aggregator else []))
        code = runner.run(stop, max_seconds=max_seconds, until_idle_s=until_idle_s)
    finally:
        stop.set()
        engine_impl.close()
        if aggregator is not None:
            # Let the aggregator read the last descriptions before it commits and leaves.
            import time

            deadline = time.monotonic() + (30 if code == 0 else 0)  # failed: the cluster may be gone, no waiting
            while time.monotonic() < deadline and time.monotonic() - aggregator.last_record_at < 3:
                time.sleep(0.2)
            aggregator_stop.set()
            # Its flush, commit and closes each wait at most kafka.request_timeout_ms.
            aggregator_thread.join(timeout=3 * settings.kafka.request_timeout_ms / 1000 + 5)
            if not code and aggregator.exit_code != 0:  # failed, or still closing (its commits wait on the cluster)
                code = aggregator.exit_code or 4
        if profiler is not None:
            profiler.stop()
        engine_thread = getattr(engine_impl, "_worker", None)
        if engine_thread is not None and engine_thread.is_alive():
            # A thread still inside torch when the interpreter tears down aborts the process ("terminate called
            # without an active exception", SIGABRT): torch's thread pools are destroyed under it. Nothing is left
            # to commit (the runner has stopped), so leave without the teardown.
            logging.getLogger(__name__).warning("the engine thread is still busy after close; exiting without "
                                                "interpreter teardown")
            logging.shutdown()
            os._exit(code if code else 1)
    raise typer.Exit(code)


def tiny_model(ctx: typer.Context, path: str = typer.Argument(..., help="Folder to write the model into."),
               family: str = typer.Option("qwen2.5-vl", "--family",
                                          help="qwen2.5-vl, qwen2-vl, qwen3-vl, qwen3-vl-moe, qwen3.5, or gemma3 / llava-onevision (the generic path)")) -> None:
    """Write a tiny random-weight model of a family (real architecture and special-token ids; no download);
    `vlmstream run --model PATH` then runs it."""
    from consumers.infer.tiny_model import TINY_FAMILY_NAMES, write_tiny_family_model

    if family not in TINY_FAMILY_NAMES:
        raise typer.BadParameter(f"--family {family!r} is not one of {', '.join(TINY_FAMILY_NAMES)}")
    print(write_tiny_family_model(path, family))

