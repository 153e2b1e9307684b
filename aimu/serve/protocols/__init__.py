"""What every protocol ``aimu serve`` speaks shares: one decoding of a run's events and
their nesting (:class:`EventStream`); each adapter (``aimu.serve.ag_ui``, ``ai_sdk``,
``a2a``, ``mcp_agent``) keeps only its wire format."""

from aimu.serve.protocols.stream import EventStream, decode, text_parts

__all__ = ["EventStream", "decode", "text_parts"]
