"""reshard as a vLLM weight-transfer backend (vLLM 0.33's ``vllm.distributed.weight_transfer``).

``import reshard.vllm`` registers a backend named ``"reshard"`` in vLLM's
``WeightTransferEngineFactory`` (the inference workers' side) and
``WeightTransferTrainerFactory`` (the trainer's side), changing nothing in
vLLM. A deployment switches to it with ``WeightTransferConfig(backend=
"reshard")`` on the engine and ``ReshardTrainerInitInfo`` on the trainer.

Phases (vLLM's four, plus the trainer's ``send_weights``):

* ``trainer_init`` (every trainer rank): the trainer's layout read from the
  ``WeightSource``'s metadata (each parameter's owners, mesh and ``Shard`` /
  ``Replicate`` placements, torch.chunk semantics: FSDP2, DTensor TP, plain
  modules), its local pieces (``iter_local()``) bound in place. The sender
  (rank 0) calls ``client.init_weight_transfer_engine`` with the store's
  address and the trainer's layout while every trainer rank sets up its end.
* ``init_transfer_engine`` (every vLLM rank): the destination layout traced
  through vLLM's own ``load_weights`` (:mod:`reshard.engines.vllm`), published,
  the plan compiled and the transport connected; all of it once.
* ``start_weight_update`` / ``update_weights`` (``receive_weights``): a refit
  straight into the live parameters, run by the trainer's ``send_weights`` on
  every trainer rank at the same time; fused, expert and padded parameters
  included; nothing is staged as a full tensor.
* ``finish_weight_update``: the version is published only when the refit
  committed on every rank (reshard's versioned commit). ``start_weight_update``
  while an update is unfinished is refused, naming ``finish_weight_update``.

After a failed update each surviving engine rank holds what its
:attr:`ReshardWeightTransferEngine.failure` says, parameter by parameter:
``written`` (the failed version entirely), ``partial`` (a mix of it and the
last published version) and ``untouched`` (the last published version);
``finish_weight_update`` raises :class:`reshard.RefitNotCommitted` carrying
the same, and the engine refuses to publish or start another update until it
is repaired: set up again (``init_transfer_engine``, which the trainer's
:meth:`ReshardTrainerEngine.repair` or a restarted trainer's ``trainer_init``
sends), then one update that commits, which is dense (every element written).

Setup fails at once everywhere: a rank that fails publishes its error on the
store, and every trainer and engine rank raises it; engines beat on the store
while they set up, so the trainer waits as long as setup takes and names a
rank that went silent. Each phase logs a line with its seconds on the
``reshard`` logger.

Rendezvous: a ``torch.distributed.TCPStore`` that trainer rank 0 hosts
(``store_host`` / ``store_port``; port 0 picks a free one, with one trainer
rank only). Transport: UCX.
``delta=True`` on the trainer's init info makes every update a delta refit
(only the elements that changed since the last committed version move,
exactly; docs/delta.md). A trainer parameter whose float dtype differs from
vLLM's (an FSDP2 f32 master copy into a bf16 engine) is cast in flight as
vLLM's loader would (round to nearest even; the sender converts, so the
engine's dtype crosses the wire); with ``delta`` only the elements whose
cast value changed move. Errors name reshard's
ranks: the trainer's ranks first, then the vLLM ranks (each message says
which are which).
The engine's life (docs/vllm.md, :mod:`reshard.vllm.lifecycle`): an update while the engine sleeps
(its ``sleep`` / ``wake_up`` hooks, called beside vLLM's) is refused; a parameter re-allocated since
setup is re-bound (the trainer sets up again and sends a dense update) or refused by name; a second
``init_transfer_engine`` closes the first setup's Resharder; the trainer's ``shutdown`` frees its
store port; vLLM other than 0.33.x and EPLB are refused at init.
A block-FP8 engine (DeepSeek-V3's ``quantization_config``) is refit from BF16 trainers with the quantizing
done in flight (:mod:`reshard.engines.fp8`; docs/vllm.md, "Block-FP8 rollouts"); FP8 modules whose
post-processing re-lays their weights are refused at init, naming them.
Not supported yet: sources whose parameters are neither plain placements nor a Megatron-Core GPTModel (use
``reshard.Resharder`` with a layout), and parameters vLLM's loader computes rather than copies (named at
init).
"""
from __future__ import annotations

from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

from .checks import TARGET_VLLM, config_differences, layout_from_param_meta, rank_legend, untraced_error
from .coordination import BEAT_SECONDS, TransferSettings, await_engines, gather_bytes, publish_error, raise_published
from .engine import ReshardInitInfo, ReshardUpdateInfo, ReshardWeightTransferEngine, failure_report
from .lifecycle import REBIND
from .trainer import BACKEND, ReshardTrainerEngine, ReshardTrainerInitInfo

__all__ = ["BACKEND", "BEAT_SECONDS", "REBIND", "ReshardInitInfo", "ReshardTrainerEngine",
           "ReshardTrainerInitInfo", "ReshardUpdateInfo", "ReshardWeightTransferEngine", "TARGET_VLLM",
           "TransferSettings", "await_engines", "config_differences", "failure_report", "gather_bytes",
           "layout_from_param_meta", "publish_error", "raise_published", "rank_legend", "register",
           "untraced_error"]


def register() -> None:
    """Registers the backend in both factories (idempotent): importing this module does it, and so does
    vLLM's plugin loader in each process it starts (the package's ``vllm.general_plugins`` entry point)."""
    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, ReshardWeightTransferEngine)
    if BACKEND not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(BACKEND, ReshardTrainerEngine)


register()
