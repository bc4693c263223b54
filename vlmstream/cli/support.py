"""Glue every subcommand shares: the global options and the settings they produce."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import typer

from vlmstream.config import Settings, load_settings


@dataclass
class CliState:
    config_file: str | None = None
    overrides: dict[str, Any] = field(default_factory=dict)


def settings_from(ctx: typer.Context, overrides: dict[str, Any] | None = None) -> Settings:
    """Defaults < config file < VLMSTREAM_* environment < global flags < this command's flags."""
    state: CliState = ctx.find_root().obj or CliState()
    merged: dict[str, Any] = {}
    for layer in (state.overrides, overrides or {}):
        for section, values in layer.items():
            if isinstance(values, dict):
                merged.setdefault(section, {}).update({k: v for k, v in values.items() if v is not None})
            elif values is not None:
                merged[section] = values
    settings = load_settings(state.config_file, merged)
    logging.getLogger().setLevel(settings.log_level.upper())
    from vlmstream.security import mask_secrets_in_logs

    mask_secrets_in_logs(settings)  # kafka-python logs its configuration, passwords included, at DEBUG
    return settings


def bootstrap(settings: Settings) -> Settings:
    """Start the local broker when the settings point at it; returns the settings unchanged."""
    from vlmstream.broker.lifecycle import ensure_broker

    ensure_broker(settings)
    return settings
