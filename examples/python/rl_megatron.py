"""The Megatron-Core trainer actor of examples/python/vllm_rl_loop.py (``--trainer megatron --train SPEC``):
one rank of a GPTModel (reshard.engines.megatron) on the trainer's gloo group, taking real optimizer steps
(a forward and backward over its pipeline stages), bound in place to ``reshard.megatron_layout`` as the
backend's source. Its peer path and the loop's checks read the full HuggingFace checkpoint the way
Megatron RL frameworks export it: gathered on trainer rank 0."""
from __future__ import annotations

from rl_actors import Trainer


class MegatronTrainer(Trainer):
    """One rank of a Megatron-Core trainer (tp, pp, ep, etp as ``spec`` says) and its end of the transfer."""

    def __init__(self, rank, world, cfg, master_port, seed, lr, optimizer, config_path, spec):
        self.join(rank, world, cfg, master_port)
        from megatron.core import parallel_state as mps

        from reshard.engines import megatron
        self.megatron, self.config_path, self.spec = megatron, config_path, spec
        self.model = megatron.build(cfg, spec, seed=seed)
        self.opt = self.optimizer(optimizer, lr)
        # The batch: the same on every rank of a data-parallel replica (its tensor and pipeline ranks).
        self.gen = self.torch.Generator().manual_seed(1000 + mps.get_data_parallel_rank())
        self.kill_at = 0

    def source(self):
        """The GPTModel bound in place to reshard.megatron_layout of the config under the spec."""
        return self.megatron.MegatronSource(self.model, self.config_path, self.spec)

    def train_step(self):
        loss = self.megatron.train_step(self.model, self.cfg["vocab_size"], self.gen)
        self.opt.step()
        self.opt.zero_grad()
        return loss

    def full_tensors(self):
        return self.megatron.hf_state(self.model, self.cfg)
