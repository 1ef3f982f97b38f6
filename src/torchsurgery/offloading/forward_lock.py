"""One thread at a time runs an offloaded model, or converts it: the forward lock.

A streamed model swaps its weights in group by group, and a conversion (``.to(dtype)``,
``.half()``...) takes the whole offload off and installs it again. A second thread inside
the same forward would see the first one's weights half swapped; a forward next to a
conversion would see a model half converted (tensors on two devices, parameters in two
dtypes). So whole forwards and whole conversions are serialised by one reentrant lock per
offload, kept across the conversions it makes: a conversion inside a forward of the same
thread (a model converting one of its layers in its own forward) takes it again.

A lock never outlives its holder. A hold is let go when its thread has ended (a thread
that a ``SystemExit`` or ``KeyboardInterrupt`` inside the forward ended skips the hook that
releases it), and when the thread that took it for a forward is no longer inside that
forward (it caught such an exception and went on): the thread waiting for it takes it over.
A thread that only waits for the lock is not running the model: the offload's own
conversion goes ahead without it (see :func:`torchsurgery._undo.waiting_on`), and the
waiting thread checks, once it holds the lock, that what it waited for is still there.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterator
from types import FrameType

from torch import nn

from torchsurgery import _undo

__all__ = ["ForwardLock"]

_POLL_S = 0.05  # how often a waiting thread looks whether the holder is gone (a hand-over wakes it at once)
_CALL = nn.Module._call_impl.__code__


class ForwardLock:
    """A reentrant lock held for a whole forward or conversion, released when its holder is gone.

    Example:
        >>> lock = ForwardLock()
        >>> with lock.held():
        ...     with lock.held():  # reentrant: the same thread
        ...         lock.holder() is threading.current_thread()
        True
        >>> lock.holder() is None
        True
    """

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._owner: threading.Thread | None = None
        self._depth = 0
        self._forward: nn.Module | None = None  # the model whose forward took it, if a forward did

    def holder(self) -> threading.Thread | None:
        """The thread holding the lock now, if any."""
        return self._owner

    def acquire(self, forward_of: nn.Module | None = None) -> None:
        """Take the lock (again, if this thread holds it), waiting for the holder to let go or be gone.

        Args:
            forward_of: the model whose forward takes it (its forward pre-hook): the hold is let
                go for the next thread once this thread is no longer inside that forward.
        """
        me = threading.current_thread()
        with self._cond:
            if self._owner is me:
                self._depth += 1
                return
            if self._owner is not None:
                with _undo.waiting_on(self):
                    while self._owner is not None and not self._gone():
                        self._cond.wait(_POLL_S)
            self._owner, self._depth, self._forward = me, 1, forward_of

    def release(self) -> None:
        """Let go of one hold of this thread (nothing if this thread holds none: a pre-hook before
        the one taking it raised, or its hold was taken over)."""
        with self._cond:
            if self._owner is not threading.current_thread():
                return
            self._depth -= 1
            if self._depth == 0:
                self._owner, self._forward = None, None
                self._cond.notify()

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """Hold the lock within the block; the offload's surgery in it goes ahead past threads waiting for it."""
        self.acquire()
        try:
            with _undo.waiters_ok(self):
                yield
        finally:
            self.release()

    def begin_forward(self, model: nn.Module) -> None:
        """Taken for a forward of ``model``, which a ``KeyboardInterrupt`` may have left held by this thread."""
        with self._cond:
            if self._owner is threading.current_thread() and self._forward is model and not _inside_twice(model):
                # an interrupted forward's hold: this thread runs no other forward of the model
                self._owner, self._depth, self._forward = None, 0, None
        self.acquire(forward_of=model)

    def _gone(self) -> bool:
        """Whether the holder is gone: its thread ended, or it left the forward it took the lock for."""
        owner = self._owner
        assert owner is not None
        if not owner.is_alive():
            return True
        if self._forward is None:
            return False  # held for a group or a conversion: released in a ``finally``, whatever ends them
        frame: FrameType | None = sys._current_frames().get(owner.ident or -1)
        try:
            while frame is not None:
                if frame.f_code is _CALL and frame.f_locals.get("self") is self._forward:
                    return False
                frame = frame.f_back
        finally:
            del frame  # a frame held here would keep the holder's frames alive
        return True


def _inside_twice(model: nn.Module) -> bool:
    """Whether the calling thread is inside a forward of ``model`` besides the one starting now."""
    frame: FrameType | None = sys._getframe(1)
    found = 0
    while frame is not None:
        if frame.f_code is _CALL and frame.f_locals.get("self") is model:
            found += 1
        frame = frame.f_back
    del frame
    return found > 1
