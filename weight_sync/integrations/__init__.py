"""Integrations with inference engines that weight_sync does not own.

Each engine gets its own subpackage (``weight_sync.integrations.vllm``) and only that subpackage imports
the engine; importing ``weight_sync`` or this package never imports an engine.
"""
