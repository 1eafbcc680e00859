"""A generation prompt's token ids: plain text, or a message list through the model's chat template.

Read only as far as the model's context needs: with a ``limit`` (the context) a prompt is tokenized from its
first characters only (:func:`~unimae.embedding.tokenization.ids_within`), so a prompt of a few MB costs what
``limit + 1`` tokens cost before it is refused, and a prompt that fits gets exactly the ids of the whole text.
"""

from __future__ import annotations

from unimae.embedding.tokenization import ids_within


def prompt_ids(tokenizer, prompt: str | list[dict], limit: int | None = None, chat: bool = False) -> list[int]:
    """Token ids of ``prompt``: a text with the tokenizer's special tokens (BOS as it adds it), or (``chat``, or a
    message list) the chat template's text (ValueError if the tokenizer has none).

    ``limit``: a prompt of at most ``limit`` tokens gets exactly its ids; a longer one gets more than ``limit``
    ids, those of its start (enough to refuse it). None: the whole prompt, however long.
    """
    if chat or isinstance(prompt, list):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("this model has no chat template; send a plain-text prompt instead")
        messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return ids_within(tokenizer, text, limit, add_special_tokens=False)
    return ids_within(tokenizer, prompt, limit)


def check_fits(prompt_tokens: int, context: int | None, what: str = "the prompt") -> None:
    """ValueError naming the limit when ``prompt_tokens`` (from :func:`prompt_ids` with ``limit=context``) are
    more than the model's ``context`` (None: no limit)."""
    if context is not None and prompt_tokens > context:
        raise ValueError(f"{what} is longer than the model's context of {context} tokens; shorten it")
