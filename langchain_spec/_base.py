"""The fields and helpers SpeculativeLLM and ChatSpeculative share."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, model_validator

from spec_batch import InvalidParameterError, SamplingParams
from spec_batch.jobs.heads import resolve_with_settings
from spec_batch.loading import shared_decoder

from ._core import CallOptions, check_decoder, check_limits, resolve_options

LS_PROVIDER = "spec_batch"

_LOAD_FIELDS = ("target", "draft", "device", "dtype", "weights", "draft_weights", "num_draft_tokens", "tree_width")


class SpeculativeParams(BaseModel):
    """Configuration of a spec-batch LangChain model. Unknown fields are errors (extra="forbid")."""

    # --- which models (arguments of spec_batch.load_decoder), or an existing decoder ---
    target: str = "default"
    """The target model: "default" (SmolLM2-135M-Instruct), a hub id, a local directory or a .gguf file."""
    draft: str = "suffix"
    """The drafter: "suffix" (suffix drafting from the prompt and output), "ngram" (prompt lookup), "none" (no
    speculation), "head:NAME" (a learned head stored by `spec-batch drafters train`, or head:/path/dir),
    "hybrid:NAME", or a draft model spec like `target`."""
    device: str = "cpu"
    dtype: str | None = None
    """torch dtype name ("float32", "bfloat16", ...); None lets the core choose."""
    weights: Literal["full", "int8", "int4", "w4a8", "auto"] = "full"
    """The target's weight storage (docs/weights.md): full (the default here, as for load_decoder), int8 / int4 /
    w4a8 weight-only (GGUF Q4/Q8 tensors as they ship), or auto (w4a8 on the CPU where the native kernels build)."""
    draft_weights: Literal["full", "int8", "int4", "w4a8", "auto"] = "full"
    """A draft model's weight storage, as `weights` (draft="self:int4" drafts with the target's file at int4)."""
    num_draft_tokens: int | None = Field(default=None, ge=1)
    """Most tokens drafted per step; None keeps the core's default."""
    tree_width: int | None = Field(default=None, ge=1)
    """A head's draft trees at batch 1 (docs/heads.md, 1: chains); None keeps the head's default."""
    decoder: Any = Field(default=None, exclude=True)
    """An existing spec_batch Decoder to use instead of loading one (then leave target/draft/... unset)."""

    # --- sampling (defaults for every call; max_tokens, temperature, top_p, top_k, seed may be overridden per call) ---
    max_tokens: int = 256
    """Most new tokens per generation."""
    temperature: float = 0.0
    """0 decodes greedily (exactly the target's greedy output); > 0 samples from the target's distribution. In
    [0, 2], OpenAI's range (spec_batch.limits), as everywhere a user sets it."""
    top_p: float = 1.0
    top_k: int = 0
    """0 turns top-k off."""
    seed: int | None = None
    """With temperature > 0: the same seed gives the same output for the same prompt, in any batch. A signed 64-bit
    integer (OpenAI's range)."""
    stop: list[str] | None = None
    """Stop strings: output is cut before the first one. A per-call `stop` replaces these."""
    response_format: dict[str, Any] | None = None
    """The output's shape, as OpenAI's `response_format` ({"type": "json_object"}, a json_schema, or the
    extensions regex, choice and lark): decoding is constrained to it (docs/structured-output.md)."""

    # --- how calls run ---
    batch_size: int = Field(default=8, ge=1)
    """Rows the core decodes together when a call has many prompts (batch/abatch/generate)."""
    timeout: float | None = Field(default=None, gt=0)
    """Seconds a call may take (waiting for the shared decoder included); past it the call raises TimeoutError
    (GenerationTimeout) and the decode is stopped. None: no limit."""
    streaming: bool = False
    """True: invoke() decodes through the streaming path, so callbacks get every new token as it is accepted."""

    @model_validator(mode="after")
    def _check_configuration(self) -> SpeculativeParams:
        check_decoder(self.decoder)
        if self.decoder is not None:
            # Values other than the defaults (LangChain re-creates models with every field filled in, e.g. for
            # configurable_fields, so "explicitly set" alone would refuse its copies).
            fields = type(self).model_fields
            both = sorted(f for f in _LOAD_FIELDS if getattr(self, f) != fields[f].default)
            if both:
                raise InvalidParameterError(
                    f"pass either decoder= or the model arguments {both}, not both: "
                    "the decoder already fixes its target and drafter"
                )
        # Fails now, with the core's message, rather than at the first call.
        check_limits(self.temperature, self.top_p, self.seed)
        SamplingParams(
            max_new_tokens=self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            stop=list(self.stop or []),
            response_format=self.response_format,
        )
        return self

    # --- helpers used by both models ---

    def _get_decoder(self) -> Any:
        """The decoder: the one given, or the process-wide one for this configuration (loaded on first use)."""
        if self.decoder is not None:
            return self.decoder
        # None keeps shared_decoder's default, so it shares that decoder with callers that leave it out.
        more = {k: getattr(self, k) for k in ("num_draft_tokens", "tree_width") if getattr(self, k) is not None}
        draft = resolve_with_settings(self.draft)  # head:NAME -> its cached directory (looked up in SQL)
        return shared_decoder(
            self.target,
            draft,
            device=self.device,
            dtype=self.dtype,
            weights=self.weights,
            draft_weights=self.draft_weights,
            **more,
        )

    def _options(self, stop: list[str] | None, kwargs: dict[str, Any]) -> CallOptions:
        return resolve_options(self, stop, kwargs)

    @property
    def _model_label(self) -> str:
        """The target's name for tracing, without loading anything."""
        return str(self.decoder.target_name) if self.decoder is not None else self.target

    @property
    def _identifying_params(self) -> dict[str, Any]:
        if self.decoder is not None:
            models: dict[str, Any] = {
                "target": self.decoder.target_name,
                "draft": self.decoder.draft_name,
                "device": str(getattr(self.decoder, "device", "")),
            }
        else:
            models = {name: getattr(self, name) for name in _LOAD_FIELDS}
        return {
            **models,
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "seed": self.seed,
            "stop": self.stop,
            "response_format": self.response_format,
        }

    def _ls_overrides(self, stop: list[str] | None, kwargs: dict[str, Any]) -> dict[str, Any]:
        model = kwargs.get("model")
        out: dict[str, Any] = {
            "ls_provider": LS_PROVIDER,
            "ls_model_name": model if isinstance(model, str) else self._model_label,
        }
        chosen_stop = stop if stop is not None else self.stop
        if chosen_stop:
            out["ls_stop"] = list(chosen_stop)
        return out

    def get_token_ids(self, text: str) -> list[int]:
        """Token ids of text under the target's own tokenizer (loads the model on first use)."""
        if getattr(self, "custom_get_token_ids", None) is not None:
            return self.custom_get_token_ids(text)  # type: ignore[attr-defined]
        return list(self._get_decoder().tokenizer.encode(text, add_special_tokens=False))
