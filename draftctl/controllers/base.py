"""The controller interface: after each drafted token, draft another or stop."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the decoder imports controllers; annotations only
    from draftctl.decode.features import FeatureRecord


UNBOUNDED = 1 << 30


class Action(enum.Enum):
    CONTINUE = "continue"  # keep the token and draft another
    STOP = "stop"  # keep the token (it is verified) and end the draft
    DISCARD = "discard"  # drop the token (never verified) and end the draft


class Controller:
    """A draft-length policy.

    The decoder, for each round: asks ``max_draft()`` for this round's budget (0 = no draft,
    plain autoregressive step), then after each drafted token calls ``decide(record)`` (only
    when ``reads_features``), and after verification tells the outcome with ``observe``.
    ``reset()`` starts a new sequence. The decoder's own ``max_draft`` cap applies on top.
    """

    #: Whether ``decide`` looks at the record. If not, the decoder skips the per-token call
    #: and the device-to-host copy of the features until the round ends.
    reads_features: bool = True
    #: Whether the controller sees each drafted token id (``see_token``) before ``decide``.
    #: Only the reference oracle does: it costs a device-to-host copy per token.
    reads_tokens: bool = False
    #: The spec string the controller was built from (set by the registry).
    spec: str = ""

    def reset(self) -> None:
        """Forget per-sequence state."""

    def max_draft(self) -> int:
        """Largest number of tokens to draft this round."""
        return UNBOUNDED

    def decide(self, record: FeatureRecord) -> Action:
        return Action.CONTINUE

    def see_token(self, token: int) -> None:
        """The id of the token about to be decided on (only when ``reads_tokens``)."""

    def observe(self, records: Sequence[FeatureRecord], n_accepted: int) -> None:
        """Hear a round's outcome: the drafted tokens' records and how many were accepted."""

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.spec or ''}>".replace(" >", ">")
