"""Fast constructors for the effects the machines build on their hot paths.

A frozen dataclass's ``__init__`` sets each field through ``object.__setattr__``, which
costs about three times a plain slotted ``__init__`` (0.50 against 0.18 us for ``Free``
on the project's VM). Each effect here is built as a plain slotted twin with the same
slots in the same order and then becomes an instance of the frozen class (the layouts
are equal, so CPython allows the ``__class__`` assignment): the result is an ordinary
instance of the frozen class, equal, hashed and printed like one built by its own
``__init__``. ``producer.Ledger._free`` builds its ``Free`` the same way inline (a
``FreeFields`` whose class becomes ``Free``), after ``register_free`` checked the layouts.
"""

from __future__ import annotations

from typing import Any


class FreeFields:
    """``producer.Free``'s slots (checked when producer registers ``Free``)."""

    __slots__ = ("blocks", "deadline", "handle", "reason", "reclaimed", "request_id")

    def __init__(self, handle: int, request_id: str, reason: str, blocks: tuple[int, ...],
                 reclaimed: tuple[int, ...], deadline: int) -> None:
        self.handle = handle
        self.request_id = request_id
        self.reason = reason
        self.blocks = blocks
        self.reclaimed = reclaimed
        self.deadline = deadline


_free_class: type = FreeFields  # producer.Free, once producer registered it


def new_free(handle: int, request_id: str, reason: str, blocks: tuple[int, ...],
             reclaimed: tuple[int, ...], deadline: int) -> Any:
    """``Free(handle, request_id, reason, blocks, reclaimed, deadline)``, built fast."""
    o: Any = FreeFields(handle, request_id, reason, blocks, reclaimed, deadline)
    o.__class__ = _free_class
    return o


def register_free(cls: type) -> None:
    """Make ``new_free`` build ``cls`` (``producer.Free``): its slots must be
    ``FreeFields``'s (``TypeError`` otherwise), and a ``new_free`` result must equal the
    instance its own ``__init__`` builds."""
    if sorted(getattr(cls, "__slots__", ())) != sorted(FreeFields.__slots__):
        raise TypeError(f"{cls.__name__}'s slots differ from the fast constructor's")
    args = (1, "r", "transferred", (0, 1), (1,), 2)
    probe: Any = FreeFields(*args)
    probe.__class__ = cls  # TypeError when the layouts differ
    if probe != cls(*args) or repr(probe) != repr(cls(*args)):
        raise TypeError(f"{cls.__name__}: the fast constructor builds a different value")
    global _free_class
    _free_class = cls
