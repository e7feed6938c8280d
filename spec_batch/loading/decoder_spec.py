"""`DecoderSpec`: everything that selects a decoder built from model names, resolved (device, weights and dtype,
the drafter kind's defaults) into one frozen, hashable value: the key of the process's shared decoders
(`factory.shared_decoder`), so that the key and what is loaded cannot drift apart.

Queue names use only its routing fields (`routing`: target, drafter, weights, dtype; spec_batch/workers/routing.py,
docs/queue.md); a worker takes the draft length and tree width from its own settings.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..core.drafting.drafter_registry import DRAFT_MODEL, DRAFTERS, HEAD, HYBRID, DrafterKind
from ..core.heads.head import EagleHead
from ..errors import InvalidParameterError
from .heads import HybridHead, head_weights
from .load import resolve_device, resolve_dtype
from .weights import Precision, resolve_precision, resolve_weights_name


def drafter_kind(draft: Any) -> DrafterKind:
    """The registered kind of a draft argument: a kind's name (or a prefix kind's NAME:REST), a loaded head (its
    kind), anything else a draft model."""
    if isinstance(draft, (str, os.PathLike)):
        return DRAFTERS.get(os.fspath(draft)) or DRAFT_MODEL
    if isinstance(draft, HybridHead):
        return HYBRID
    if isinstance(draft, EagleHead):
        return HEAD
    return DRAFT_MODEL


def cache_dir_key(cache_dir: str | os.PathLike | None) -> str | None:
    return None if cache_dir is None else str(Path(cache_dir).expanduser().resolve())


@dataclass(frozen=True)
class DecoderSpec:
    """A decoder from names, every field resolved: two specs are equal exactly when they load the same decoder."""

    target: str
    draft: str
    device: str  # "cpu", "cuda:0", ...: str(torch.device)
    weights: str  # the target's effective weights (full | int8 | int4 | ...)
    dtype: torch.dtype  # its compute dtype
    draft_weights: str  # a head's effective drafting weights (full | int8); else the weights name asked (None: full)
    num_draft_tokens: int  # the longest draft per step (the kind's default where none was asked)
    tree_width: int  # 1 for a kind that drafts chains
    adaptive: bool = True
    drafter_options: tuple[tuple[str, Any], ...] = ()  # sorted (name, value) pairs
    ngram_min: int = 1
    ngram_max: int = 3
    cache_dir: str | None = None  # resolved
    trust_remote_code: bool = False

    @classmethod
    def of(
        cls,
        target: str | os.PathLike = "default",
        draft: str | os.PathLike = "suffix",
        *,
        device: str | torch.device = "cpu",
        dtype: str | torch.dtype | None = None,
        num_draft_tokens: int | None = None,
        adaptive: bool = True,
        cache_dir: str | os.PathLike | None = None,
        weights: str | None = None,
        draft_weights: str | None = None,
        tree_width: int | None = None,
        drafter_options: Mapping[str, Any] | None = None,
        ngram_min: int = 1,
        ngram_max: int = 3,
        trust_remote_code: bool = False,
    ) -> DecoderSpec:
        """The spec of load_decoder's arguments (names only), with its defaults and resolutions applied: "cpu" and
        torch.device("cpu"), a default and its value, are one spec."""
        dev = resolve_device(device)
        precision = resolve_precision(weights, dtype, dev, resolve_dtype(dtype, dev))
        kind = drafter_kind(draft)
        options = tuple(sorted((drafter_options or {}).items()))
        try:
            hash(options)
        except TypeError as exc:
            raise InvalidParameterError(f"drafter_options {dict(options)} must have hashable values") from exc
        return cls(
            target=os.fspath(target),
            draft=os.fspath(draft),
            device=str(dev),
            weights=precision.weights,
            dtype=precision.dtype,
            # what a head drafts with (None and auto: int8 on the CPU) or, for a draft model, the weights asked
            draft_weights=head_weights(draft_weights, dev)
            if kind in (HEAD, HYBRID)
            else resolve_weights_name(draft_weights),
            num_draft_tokens=kind.default_draft_tokens if num_draft_tokens is None else num_draft_tokens,
            tree_width=kind.tree_width(tree_width),
            adaptive=adaptive,
            drafter_options=options,
            ngram_min=ngram_min,
            ngram_max=ngram_max,
            cache_dir=cache_dir_key(cache_dir),
            trust_remote_code=bool(trust_remote_code),
        )

    @property
    def precision(self) -> Precision:
        return Precision(self.weights, self.dtype)

    @property
    def routing(self) -> tuple[str, str, str, str]:
        """(target, drafter, weights, dtype name): the fields a job's queue is named by (routing.queue_name)."""
        return self.target, self.draft, self.weights, self.precision.dtype_name

    def load_call(self) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """load_decoder's (positional, keyword) arguments for this spec."""
        positional = (self.target, self.draft, torch.device(self.device), self.dtype)
        return positional, dict(
            num_draft_tokens=self.num_draft_tokens,
            adaptive=self.adaptive,
            ngram_min=self.ngram_min,
            ngram_max=self.ngram_max,
            drafter_options=dict(self.drafter_options) or None,
            cache_dir=self.cache_dir,
            trust_remote_code=self.trust_remote_code,
            weights=self.weights,
            draft_weights=self.draft_weights,
            tree_width=self.tree_width,
        )
