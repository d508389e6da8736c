"""A request body in the pieces the HTTP parser handed over, never joined on the event loop.

An agent's turn with four screenshots is a 7 MB body. Joining it allocates fresh memory and faults
in ~1,700 pages: about 5 ms with the loop doing nothing else, where /health answers in 0.1 ms. So
the pieces go to a tokenizer worker as they came (one frame: a list in a PipeLink message, written
256 KiB per loop turn), and the gateway looks only at the body's ends: the conversation key at its head,
Responses' ``prompt_cache_key`` and Anthropic's ``stream`` at either end.
"""

from __future__ import annotations

HEAD_BYTES = 132 << 10  # what conversation_key reads: "messages" within 64 KiB, its user message within 64 KiB more


class RequestBody:
    """One request's body: its pieces, their total, and how much came since the app last looked
    (http_protocol sets ``unread``; the app's ``receive()`` loop clears it)."""

    __slots__ = ("pieces", "size", "unread", "_head")

    def __init__(self, pieces: list | None = None) -> None:
        self.pieces: list[bytes] = pieces if pieces is not None else []
        self.size = sum(map(len, self.pieces))
        self.unread = 0
        self._head: bytes | None = None  # head(), once the body is whole: the key and the stream flag both read it

    def append(self, piece: bytes) -> None:
        self.pieces.append(piece)
        self.size += len(piece)
        self.unread += len(piece)

    def __len__(self) -> int:
        return self.size

    def head(self) -> bytes:
        """The first HEAD_BYTES (all of a shorter body), joined once; read only once the body is whole."""
        if self._head is None:
            self._head = self.first(HEAD_BYTES)
        return self._head

    def first(self, limit: int) -> bytes:
        """The first ``limit`` bytes (all of a shorter body); the first piece itself when it holds them."""
        pieces = self.pieces
        if not pieces:
            return b""
        if len(pieces[0]) >= min(limit, self.size):
            return pieces[0] if len(pieces[0]) <= limit else pieces[0][:limit]
        taken, total = [], 0
        for piece in pieces:
            taken.append(piece)
            total += len(piece)
            if total >= limit:
                break
        return b"".join(taken)[:limit]

    def tail(self, limit: int) -> bytes:
        """The last ``limit`` bytes (all of a shorter body)."""
        taken, total = [], 0
        for piece in reversed(self.pieces):
            taken.append(piece)
            total += len(piece)
            if total >= limit:
                break
        joined = b"".join(reversed(taken))
        return joined[-limit:] if len(joined) > limit else joined

    def __contains__(self, needle: bytes) -> bool:
        """Whether ``needle`` occurs anywhere, across the seams between pieces too."""
        keep, carry = len(needle) - 1, b""  # carry: the body's last ``keep`` bytes before this piece
        for piece in self.pieces:
            if needle in piece or (carry and needle in carry + piece[:keep]):
                return True
            carry = piece[len(piece) - keep :] if len(piece) >= keep else (carry + piece)[-keep:]
        return False

    def joined(self) -> bytes:
        """The body in one bytes object: for a ZeroMQ frame to a remote worker and the in-process baselines."""
        return self.pieces[0] if len(self.pieces) == 1 else b"".join(self.pieces)
