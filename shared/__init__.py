"""SeamlessFlow's wire contract: messages, subjects, stream specs, codec, bus and config.

Every service imports this package and nothing from another service. It knows
nothing about HTTP, vLLM, DeepSpeed or Redis key layouts: those belong to the
services that own them.
"""
