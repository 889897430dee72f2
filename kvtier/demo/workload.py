"""The demo's workload: multi-turn conversations over shared prompts and documents.

Every conversation opens with one of a few system prompts and one of a pool of
documents (chosen with a skew: a few documents are popular, the rest come up
now and then), then runs a few turns of user messages and model answers. The
requests go in rounds, turn 1 of every conversation, then turn 2, and so on, so
a conversation comes back only after all the others have had a turn: by then
its history has usually left the CPU tier and comes back from the file tier,
while popular openings stay in the CPU tier. The token streams are random,
drawn from a seed; the model's answers are its own greedy tokens.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

__all__ = ["Conversation", "WorkloadSettings", "build_conversations", "prompt_of", "schedule"]


@dataclass(frozen=True, slots=True)
class WorkloadSettings:
    """Shape of the workload."""

    conversations: int = 20
    """Independent conversations."""
    turns: int = 3
    """Requests per conversation; each prompt extends the previous one with its
    answer and a new user message."""
    system_prompts: int = 2
    """Distinct system prompts, shared round-robin by the conversations."""
    system_tokens: int = 256
    """Tokens of each system prompt."""
    documents: int = 8
    """Distinct documents; conversation ``i`` picks one with weight ``1 / (rank + 1)``."""
    document_tokens: int = 1024
    """Tokens of each document."""
    user_tokens: tuple[int, int] = (48, 160)
    """Smallest and largest user message, in tokens."""
    answer_tokens: int = 8
    """Tokens the model generates per request (greedy)."""
    seed: int = 0
    """Seed of the token streams and of the order."""


@dataclass(frozen=True, slots=True)
class Conversation:
    """One conversation's fixed parts; the answers come from the model."""

    index: int
    """Position among the conversations."""
    opening: tuple[int, ...]
    """System prompt and document tokens."""
    messages: tuple[tuple[int, ...], ...]
    """The user message of each turn."""


def build_conversations(settings: WorkloadSettings, vocab: int) -> list[Conversation]:
    """Draw the conversations' token streams from ``settings.seed``.

    Parameters
    ----------
    settings
        The workload's shape.
    vocab
        Token ids are below it.

    Returns
    -------
    list[Conversation]
        ``settings.conversations`` conversations, equal for equal settings.
    """
    rng = random.Random(settings.seed)

    def tokens(n: int) -> tuple[int, ...]:
        return tuple(rng.randrange(vocab) for _ in range(n))

    systems = [tokens(settings.system_tokens) for _ in range(settings.system_prompts)]
    documents = [tokens(settings.document_tokens) for _ in range(settings.documents)]
    weights = [1.0 / (rank + 1) for rank in range(settings.documents)]
    low, high = settings.user_tokens
    out = []
    for i in range(settings.conversations):
        doc = rng.choices(range(settings.documents), weights)[0]
        opening = systems[i % settings.system_prompts] + documents[doc]
        messages = tuple(tokens(rng.randint(low, high)) for _ in range(settings.turns))
        out.append(Conversation(i, opening, messages))
    return out


def schedule(settings: WorkloadSettings) -> list[tuple[int, int]]:
    """The order requests arrive in: ``(conversation, turn)`` pairs, round by round.

    Within a round the conversations come in a shuffled order (from
    ``settings.seed``), so that a conversation's turns are not evenly spaced.
    """
    rng = random.Random(settings.seed + 1)
    order = []
    for turn in range(settings.turns):
        convs = list(range(settings.conversations))
        rng.shuffle(convs)
        order += [(c, turn) for c in convs]
    return order


def prompt_of(conversation: Conversation, turn: int, answers: list[list[int]]) -> list[int]:
    """The prompt of ``turn``: opening, then each earlier message and its answer."""
    out = list(conversation.opening)
    for t in range(turn):
        out += conversation.messages[t]
        out += answers[t]
    out += conversation.messages[turn]
    return out
