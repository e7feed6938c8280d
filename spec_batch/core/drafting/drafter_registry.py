"""The drafters by kind, in one registry (`DRAFTERS`): each kind's name, how its drafter is made and its defaults
(draft length, tree width, whether it drafts from a job memory, which options a user may tune). Nothing else in
the project chooses by a drafter's name: loading, the CLI and the decoder ask the registry
(tests/test_drafter_names_rule.py holds that). Adding a drafter: docs/architecture.md, "Adding a drafter".

Two sorts of kind:
- named whole ("suffix", "ngram", "none"): drafting needs no model; `make` builds the drafter factory;
- prefix kinds ("self:WEIGHTS", "head:DIR", "hybrid:DIR"): drafting needs a model or a head, which the loading
  layer resolves and loads (spec_batch/loading/factory.py); the kind carries only its defaults.

Torch-free, so that the CLI lists and checks names without importing a model library: a kind's `make` may be
given as "module:function", imported on first use.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ...errors import InvalidParameterError

if TYPE_CHECKING:
    from .drafters import Drafter

DEFAULT_DRAFT_TOKENS = 8  # num_draft_tokens of kinds without a default of their own (a draft model: a forward each)


@dataclass(frozen=True)
class DraftSettings:
    """What a kind's `make` is given: the user's drafter_options (already checked against the kind's `options`)
    and the n-gram sizes (load_decoder's ngram_min, ngram_max)."""

    options: Mapping[str, Any] = field(default_factory=dict)
    ngram_min: int = 1
    ngram_max: int = 3


# settings -> the factory of the drafter of each running batch; checks the settings now, not at the first decode
MakeDrafter = Callable[[DraftSettings], Callable[[], "Drafter"]]


@dataclass(frozen=True)
class DrafterKind:
    """One kind of drafter and its defaults."""

    name: str
    make: MakeDrafter | str | None = None  # None: made from a model by the loading layer (prefix kinds)
    default_draft_tokens: int = DEFAULT_DRAFT_TOKENS  # num_draft_tokens where none is given
    # tree_width where none is given; None: the kind drafts chains, width 1 whatever is asked (so one
    # SPEC_BATCH_TREE_WIDTH serves a worker's head and suffix jobs alike)
    default_tree_width: int | None = None
    drafts_from_memory: bool = False  # its drafter drafts from a job memory: only then is one worth keeping
    drafts: bool = True  # False: plain decoding through the same loop (no draft tokens at all)
    options: tuple[str, ...] = ()  # the drafter_options a user may tune
    prefix: bool = False  # named "NAME:REST" (head:DIR); False: named exactly NAME
    bare: bool = False  # a prefix kind that may also be named alone ("self" is "self:int4")
    usage: str = ""  # how a prefix kind is named in messages ("head:NAME"); empty: its name

    def factory(self, settings: DraftSettings) -> Callable[[], Drafter]:
        """The drafter factory for these settings: drafter_options checked against `options`, then `make`."""
        unknown = sorted(set(settings.options) - set(self.options))
        if unknown:
            raise InvalidParameterError(
                f"unknown drafter_options {unknown} for {self.name!r}; known: {list(self.options)}"
            )
        make = self.make
        if make is None:
            raise InvalidParameterError(f"drafter {self.name!r} is made from a model (load_decoder)")
        if isinstance(make, str):
            module, _, attr = make.partition(":")
            make = getattr(importlib.import_module(module), attr)
        return make(settings)  # type: ignore[operator]

    def tree_width(self, asked: int | None) -> int:
        """The tree width a decoder of this kind gets for the width asked (None: the kind's default)."""
        if asked is not None and (isinstance(asked, bool) or not isinstance(asked, int) or asked < 1):
            raise InvalidParameterError(f"tree_width must be a whole number >= 1, got {asked!r}")
        if self.default_tree_width is None:
            return 1
        return self.default_tree_width if asked is None else asked


class DrafterRegistry:
    """Kinds by name. `get` maps a draft argument (a name, or a prefix kind's NAME:REST) to its kind."""

    def __init__(self) -> None:
        self._kinds: dict[str, DrafterKind] = {}

    def register(self, kind: DrafterKind) -> DrafterKind:
        if ":" in kind.name or not kind.name:
            raise ValueError(f"a drafter kind's name is a word without ':', got {kind.name!r}")
        if kind.name in self._kinds:
            raise ValueError(f"drafter kind {kind.name!r} is registered already")
        self._kinds[kind.name] = kind
        return kind

    def unregister(self, name: str) -> None:
        self._kinds.pop(name, None)

    @contextmanager
    def registered(self, kind: DrafterKind) -> Iterator[DrafterKind]:
        """The kind registered within the block (tests, plugins tried out)."""
        self.register(kind)
        try:
            yield kind
        finally:
            self.unregister(kind.name)

    def kinds(self) -> tuple[DrafterKind, ...]:
        return tuple(self._kinds.values())

    def named(self) -> tuple[str, ...]:
        """The names of the kinds named whole ("suffix", "ngram", "none"), in registration order."""
        return tuple(k.name for k in self._kinds.values() if not k.prefix)

    def listing(self) -> str:
        """'"suffix", "ngram", "none"': the kinds named whole, for help texts and error messages."""
        return ", ".join(f'"{name}"' for name in self.named())

    def usage(self) -> str:
        """Every kind as a draft argument names it, for error messages: '"suffix", "ngram", "none", "head:NAME", ...'."""
        return ", ".join(f'"{k.usage or k.name}"' for k in self._kinds.values())

    def get(self, draft: str) -> DrafterKind | None:
        """The kind a draft argument names; None for anything else (a draft model's name or path)."""
        kind = self._kinds.get(draft)
        if kind is not None and (not kind.prefix or kind.bare):
            return kind
        head, sep, _ = draft.partition(":")
        kind = self._kinds.get(head)
        return kind if sep and kind is not None and kind.prefix else None

    def claims(self, draft: str) -> bool:
        """Whether draft is no model's name to check here: a kind named whole, or a prefix kind's NAME[:...]
        (self:WEIGHTS is the target's own file; a head is resolved by the worker)."""
        if self.get(draft) is not None:
            return True
        kind = self._kinds.get(draft.partition(":")[0])
        return kind is not None and kind.prefix

    def drafts(self, draft_name: str) -> bool:
        """Whether a decoder whose drafter has this name drafts at all (every name but a non-drafting kind's)."""
        kind = self._kinds.get(draft_name)
        return kind is None or kind.drafts


DRAFTERS = DrafterRegistry()

# ---------------------------------------------------------------- the built-in kinds

# suffix trees over the row and its job's other outputs (core/drafting/suffix_drafter.py). Draft length 16: proposals cost
# nothing and the policy trims each row by its confidence, so a longer cap only lets long copies run
# (docs/benchmarks.md); draft models keep 8, each draft token being a draft forward.
SUFFIX = DRAFTERS.register(
    DrafterKind(
        "suffix",
        make="spec_batch.core.drafting.suffix_drafter:suffix_factory",
        default_draft_tokens=16,
        drafts_from_memory=True,
        options=("max_spec_factor", "min_token_prob"),
    )
)
NGRAM = DRAFTERS.register(DrafterKind("ngram", make="spec_batch.core.drafting.drafters:ngram_factory"))  # prompt lookup
NONE = DRAFTERS.register(DrafterKind("none", make="spec_batch.core.drafting.drafters:none_factory", drafts=False))
# the target's own file at other weights ("self" alone: int4), loaded as a draft model
SELF = DRAFTERS.register(DrafterKind("self", prefix=True, bare=True, usage="self[:WEIGHTS]"))
# a learned head (core/heads/head_drafter.py) grows draft trees at small batches (core/drafting/tree.py; docs/heads.md)
HEAD = DRAFTERS.register(DrafterKind("head", prefix=True, default_tree_width=3, usage="head:NAME"))
# suffix where its match is confident, the head elsewhere (core/heads/hybrid_drafter.py): the suffix part drafts from
# the job memory, the head's rows grow trees
HYBRID = DRAFTERS.register(
    DrafterKind("hybrid", prefix=True, default_tree_width=3, drafts_from_memory=True, usage="hybrid:NAME")
)
# not registered: any other draft is a draft model (a name, a path or a loaded model)
DRAFT_MODEL = DrafterKind("draft-model")
