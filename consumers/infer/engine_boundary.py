"""What crosses from the inference consumer to our tower in vLLM's engine process, as one validated object.

vLLM imports engine_tower.py in its engine process, which the consumer does not run: what the consumer decided and
the engine side needs (the model family it resolved, whether and how many embeddings the engine keeps for it, the vLLM
release it checked) crosses as one ``EngineTowerConfig``, serialised once (JSON) into the environment variable
ENVIRONMENT_VARIABLE of the engine process the consumer starts, and validated there. The engine side reads no
settings and takes no defaults: a missing or malformed value stops it with an error that says so.
"""

from __future__ import annotations

import os

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from vlmstream.config import InferSettings
from vlmstream.models.family import ModelFamily

# A process variable, not a setting (settings variables are VLMSTREAM_<SECTION>__<NAME>).
ENVIRONMENT_VARIABLE = "VLMSTREAM_ENGINE_TOWER"
# The most sequences vLLM 0.26's engine runs at once when infer.max_num_seqs leaves the choice to it (its offline
# default on an H100 or H200): the consumer's in-flight bound follows the engine's batch, known only once it runs.
VLLM_LARGEST_DEFAULT_BATCH = 1024


class EngineTowerConfig(BaseModel):
    """The consumer's decisions that our tower in vLLM's engine process needs. Every field must be given."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    vllm_version: str = Field(description="The vLLM release the consumer checked against vllm_adapter.CHECKED_VLLM; "
                                          "the engine process runs the same installation.")
    checkpoint: str = Field(description="The checkpoint the consumer gave vLLM (infer.model as resolved), whose "
                                        "vision weights the engine side's tower loads.")
    family: str = Field(description="The model family the consumer resolved from the checkpoint; the tower the "
                                    "engine side builds must be of it.")
    keep_embeddings: bool = Field(description="Whether the engine keeps tagged images' embeddings for the consumer "
                                              "(infer.publish_embeddings).")
    embeddings_kept_at_most: int = Field(ge=1, description="How many kept embeddings may wait for the consumer; "
                                                           "the oldest go first beyond it.")

    @classmethod
    def for_engine(cls, checkpoint: str, family: ModelFamily, settings: InferSettings,
                   vllm_version: str) -> EngineTowerConfig:
        """The consumer's side. Every kept embedding belongs to an image in flight or to a request the engine dropped
        (aborted), so twice the consumer's in-flight bound never pushes out one the consumer will ask for."""
        in_flight = settings.images_in_flight(settings.max_num_seqs or VLLM_LARGEST_DEFAULT_BATCH)
        return cls(vllm_version=vllm_version, checkpoint=checkpoint, family=family.name,
                   keep_embeddings=settings.publish_embeddings, embeddings_kept_at_most=2 * in_flight)

    def environment(self) -> dict[str, str]:
        """The engine process's environment entry that carries this object."""
        return {ENVIRONMENT_VARIABLE: self.model_dump_json()}

    @classmethod
    def from_environment(cls, environ=None) -> EngineTowerConfig:
        """The engine's side: the object the consumer put in this process's environment."""
        raw = (os.environ if environ is None else environ).get(ENVIRONMENT_VARIABLE)
        if raw is None:
            raise RuntimeError(f"{ENVIRONMENT_VARIABLE} is not set in vLLM's engine process: vlmstream's tower there "
                               "is configured by the inference consumer that starts the engine (VllmEngine), not on "
                               "its own")
        try:
            return cls.model_validate_json(raw)
        except ValidationError as exc:
            raise RuntimeError(f"{ENVIRONMENT_VARIABLE} in vLLM's engine process is not a valid EngineTowerConfig "
                               f"(the consumer and the engine run different vlmstream code?): {exc}") from exc
