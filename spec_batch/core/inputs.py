"""generate()'s inputs, checked before anything is decoded: prompts (text or token ids) and sampling params."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import InvalidParameterError, InvalidPromptError, PromptTooLongError
from .params import SamplingParams

if TYPE_CHECKING:
    from .structured.grammar import GrammarState

Prompt = str | list[int]


@dataclass(frozen=True, eq=False)
class PreparedRequest:
    """A prompt checked and ready to join a batch (Decoder.prepare): `index`, its place among its call's prompts;
    `ids`, its token ids; `params`; `grammar`, the matcher of its response_format (None: free text)."""

    index: int
    ids: list[int]
    params: SamplingParams
    grammar: GrammarState | None = None


def params_list(params: SamplingParams | Sequence[SamplingParams] | None, n: int) -> list[SamplingParams]:
    """One SamplingParams per prompt, from one for all (None: the defaults) or one each."""
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    plist = list(params)
    if len(plist) != n:
        raise InvalidParameterError(f"got {len(plist)} SamplingParams for {n} prompts")
    return plist


def prompt_ids(
    prompt: Prompt,
    params: SamplingParams,
    index: int,
    *,
    tokenizer: Any,
    vocab_size: int,
    max_context: int,
    model_name: str,
) -> list[int]:
    """The prompt's token ids (text is encoded as given, no chat template); errors name the prompt's index."""
    if isinstance(prompt, str):
        ids = tokenizer.encode(prompt)
    elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        ids = list(prompt)
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise _bad_prompt(index, f"token id {bad[0]} is outside the vocabulary (0..{vocab_size - 1})")
    else:
        raise _bad_prompt(index, f"expected a string or a list of token ids, got {type(prompt).__name__}")
    if not ids:
        raise InvalidPromptError(f"prompt {index} is empty", prompt_index=index, detail="the prompt is empty")
    outside = sorted(t for t in params.logit_bias if t >= vocab_size)
    if outside:
        raise _bad_prompt(
            index, f"logit_bias names token id {outside[0]}, outside the vocabulary (0..{vocab_size - 1})"
        )
    if len(ids) + params.max_new_tokens > max_context:
        rest = (
            f"has {len(ids)} tokens; with max_new_tokens={params.max_new_tokens} it needs "
            f"{len(ids) + params.max_new_tokens} positions but {model_name!r} has a context of "
            f"{max_context}: shorten the prompt or lower max_new_tokens"
        )
        raise PromptTooLongError(f"prompt {index} {rest}", prompt_index=index, detail=f"the prompt {rest}")
    return ids


def _bad_prompt(index: int, detail: str) -> InvalidPromptError:
    return InvalidPromptError(f"prompt {index}: {detail}", prompt_index=index, detail=detail)
