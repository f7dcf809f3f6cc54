"""Conversations -> chat-template token rows with an assistant-only loss mask.

speculators 0.9.0 (``preprocessing._render_boundary_rows``) renders through vLLM's ``/render``
endpoint; here the same target chat template is rendered locally through transformers'
``apply_chat_template`` (the function vLLM renders with; see ``specjax.models.tokenizer``).
For every assistant turn ``j > 0`` one row: ``prompt = render(conv[:j], add_generation_prompt=True)``,
``full = render(conv[:j+1])``; the boundary is ``len(prompt)`` when ``full`` extends ``prompt``,
else their common prefix (only when the history render is itself a prefix of ``full``);
``loss_mask = 0 * boundary + 1 * rest``. A template that marks assistant tokens with
``{% generation %}`` says itself which tokens the assistant produced: there the mask past the
boundary is transformers' ``return_assistant_tokens_mask`` of ``full`` (so a turn's header and
whatever the template appends after the ``{% endgeneration %}`` stay unsupervised). Rows are
clipped to ``max_length`` and dropped when no supervised token (or fewer than
``minimum_valid_tokens``) remains.
"""

from __future__ import annotations

from specjax.train.prompts import Conversation


class BoundaryUnstableError(ValueError):
    """The chat template is not prefix-stable at an assistant-turn boundary."""


def render_ids(tokenizer, conv: Conversation, *, add_generation_prompt: bool) -> list[int]:
    return list(tokenizer.apply_chat_template(conv, add_generation_prompt=add_generation_prompt, tokenize=True))


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def conversation_rows(tokenizer, conv: Conversation, *, max_length: int,
                      minimum_valid_tokens: int | None = None) -> list[tuple[list[int], list[int]]]:
    """One ``(input_ids, loss_mask)`` row per assistant turn after the first message."""
    rows = []
    marked = tokenizer.uses_generation_mask
    for j, turn in enumerate(conv):
        if turn["role"] != "assistant" or j == 0:
            continue
        prompt = render_ids(tokenizer, conv[:j], add_generation_prompt=True)
        if len(prompt) >= max_length:
            continue
        if marked:  # one render gives the ids and the template's own assistant-token mask
            full, generated = tokenizer.apply_chat_template(conv[: j + 1], add_generation_prompt=False, tokenize=True,
                                                            return_assistant_tokens_mask=True)
        else:
            full = render_ids(tokenizer, conv[: j + 1], add_generation_prompt=False)
        if full[: len(prompt)] == prompt:
            boundary = len(prompt)
        else:
            boundary = _common_prefix(prompt, full)
            hist = render_ids(tokenizer, conv[:j], add_generation_prompt=False)
            if full[: len(hist)] != hist or boundary < len(hist):
                raise BoundaryUnstableError(f"prompt and full renders diverge inside history at assistant turn {j}")
        mask = [0] * boundary + (generated[boundary:] if marked else [1] * (len(full) - boundary))
        ids, mask = full[:max_length], mask[:max_length]
        n_valid = sum(mask)
        if n_valid == 0 or (minimum_valid_tokens is not None and n_valid < minimum_valid_tokens):
            continue
        rows.append((ids, mask))
    return rows
