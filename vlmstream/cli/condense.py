"""`vlmstream condense`: the condensation consumer (results in, one structured answer per document out)."""

from typing import Optional

import typer


def resolve_condense_model(settings) -> str:
    """condense.model, else infer.model (one checkpoint serves both steps), else the built-in tiny model."""
    if settings.condense.model:
        return settings.condense.model
    if settings.infer.model:
        return settings.infer.model
    from consumers.infer.tiny_model import default_tiny_model_dir

    return str(default_tiny_model_dir())


def condense(
    ctx: typer.Context,
    model: Optional[str] = typer.Option(None, "--model", help="Language model (HF id or folder); default: "
                                        "infer.model's checkpoint, text only, or the tiny model."),
    engine: Optional[str] = typer.Option(None, "--engine", help="auto, vllm or transformers."),
    answer_schema: Optional[str] = typer.Option(None, "--answer-schema", help="JSON Schema file of the answer; "
                                                "default: type, condition, notable_characteristics."),
    prompt_file: Optional[str] = typer.Option(None, "--prompt-file", help="File holding the prompt template "
                                              "({doc_id}, {image_count}, {metadata}, {descriptions}, {schema})."),
    prompt_id: Optional[str] = typer.Option(None, "--prompt-id"),
    max_new_tokens: Optional[int] = typer.Option(None, "--max-new-tokens"),
    max_prompt_tokens: Optional[int] = typer.Option(None, "--max-prompt-tokens", help="Context budget; longer "
                                                    "documents' descriptions are cut (each keeps its head)."),
    batch_size: Optional[int] = typer.Option(None, "--batch-size"),
    gpu_memory_utilization: Optional[float] = typer.Option(None, "--gpu-memory-utilization", help="vLLM: this "
                                                           "engine's share of the GPU's memory."),
    exactly_once: bool = typer.Option(False, "--exactly-once", help="Transactional summaries + offsets."),
    group_id: Optional[str] = typer.Option(None, "--group-id"),
    max_seconds: Optional[float] = typer.Option(None, "--max-seconds", help="Stop (draining) after this long."),
    until_idle_s: Optional[float] = typer.Option(None, "--until-idle-s", help="Stop when idle this long."),
) -> None:
    """Read document results, prompt a language model with each document's image descriptions, publish one answer
    per document (valid against the answer schema) to the summaries topic; what cannot be answered is a dead letter.

    SIGTERM/SIGINT: stop fetching, let the engine finish what it holds (up to 120 s), flush, commit, leave the group.
    A second signal stops at once (nothing more is committed). Exit 3: the engine died; 4: the cluster did not
    acknowledge outputs (nothing committed past them).
    """
    import logging
    import os

    from consumers.condense.factory import make_engine
    from consumers.condense.runner import CondenseRunner
    from consumers.condense.stage import AnswerSchema, Condenser, load_prompt_template
    from vlmstream.cli.support import bootstrap, settings_from
    from vlmstream.stopping import Stop

    overrides = {
        "model": model, "engine": engine, "answer_schema": answer_schema, "prompt_file": prompt_file,
        "prompt_id": prompt_id, "max_new_tokens": max_new_tokens, "max_prompt_tokens": max_prompt_tokens,
        "batch_size": batch_size, "gpu_memory_utilization": gpu_memory_utilization, "group_id": group_id,
        "exactly_once": True if exactly_once else None,
    }
    settings = bootstrap(settings_from(ctx, {"condense": overrides}))
    log = logging.getLogger(__name__)
    try:  # settings errors first, before a model loads: each names the setting that fixes it
        schema = AnswerSchema.load(settings.condense.answer_schema)
        template = load_prompt_template(settings.condense)
    except ValueError as exc:
        log.error("%s", exc)
        raise typer.Exit(2)
    stop = Stop("vlmstream condense").install()
    try:
        engine_impl = make_engine(settings.condense, resolve_condense_model(settings), schema)
    except ValueError as exc:  # an answer schema the engine cannot enforce, a context budget over the model's
        log.error("%s", exc)
        raise typer.Exit(2)
    code = 1
    try:
        runner = CondenseRunner(settings, engine_impl, Condenser(settings.condense, engine_impl.tokenizer, schema,
                                                                 template))
        if settings.metrics_port > 0:
            from consumers.condense.metrics import serve

            serve(runner, settings.metrics_port)
        code = runner.run(stop, max_seconds=max_seconds, until_idle_s=until_idle_s)
    finally:
        engine_impl.close()
        worker = getattr(engine_impl, "_worker", None)
        if worker is not None and worker.is_alive():
            # A thread still inside torch at interpreter teardown aborts the process; nothing is left to commit.
            log.warning("the engine thread is still busy after close; exiting without interpreter teardown")
            logging.shutdown()
            os._exit(code if code else 1)
    raise typer.Exit(code)
