"""The two base classes of every wire model (protocol.py, protocol_tools.py): pure pydantic.

RequestModel    strict types (a string where a number belongs is a 400), unknown fields ignored
ResponseModel   every field written, except those in `omit_if_none` when they are None
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, SerializerFunctionWrapHandler, model_serializer


class RequestModel(BaseModel):
    """Strict types, unknown fields ignored."""

    model_config = ConfigDict(strict=True, extra="ignore")


class ResponseModel(BaseModel):
    """Every field is written, except those in `omit_if_none` when they are None."""

    omit_if_none: ClassVar[frozenset[str]] = frozenset()

    @model_serializer(mode="wrap")
    def _omit_none(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data: dict[str, Any] = handler(self)
        for name in self.omit_if_none:
            if name in data and data[name] is None:
                del data[name]
        return data
