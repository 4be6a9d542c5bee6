"""The simulated executor: executor/base.py's StepExecutor with no model. A step's duration
comes from the cost model and its sampled token is a placeholder, so the real scheduler, queues
and KV pool run unchanged on a virtual clock. It holds no KV bytes (nor weights), so it is not
a full `Executor`: a simulated P/D transfer is costed on the interconnect (sim/cluster.py)."""

from __future__ import annotations

from tandem.core.outputs import ModelRunnerOutput, SchedulerOutput
from tandem.sim.cost_model import BatchShape, CostModel

SIM_TOKEN = 0  # what every simulated step samples; never an EOS (simulated requests have none)


class SimulatedExecutor:
    def __init__(self, cost: CostModel) -> None:
        self.cost = cost
        self.block_size = cost.block_size
        self.kv_group_windows: tuple[int | None, ...] = (None,)  # the plain KV layout
        self.num_kv_blocks = cost.kv_capacity_tokens // cost.block_size
        self.num_host_blocks = cost.host_kv_capacity_tokens // cost.block_size
        self.num_tokens: dict[str, int] = {}  # the persistent batch: tokens per request

    def preemption_costs(self) -> tuple[float, float]:
        return self.cost.preemption_costs()

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        for req_id in so.finished_req_ids | so.preempted_req_ids:
            self.num_tokens.pop(req_id, None)
        computed = {}
        for new in so.scheduled_new_reqs:
            self.num_tokens[new.req_id] = len(new.prompt_token_ids) + len(new.output_token_ids)
            computed[new.req_id] = new.num_computed_tokens
        for cached in so.scheduled_cached_reqs:
            computed[cached.req_id] = cached.num_computed_tokens
        prefill = attention = decodes = context = 0
        sampled = {}
        for req_id, n in so.num_scheduled_tokens.items():
            before, total = computed[req_id], self.num_tokens[req_id]
            if n == 1 and before == total - 1:
                decodes += 1
                context += total
            else:
                prefill += n
                attention += n * (before + n)
            if before + n >= total:  # the chunk reaches the last token: it samples one
                sampled[req_id] = [SIM_TOKEN]
                self.num_tokens[req_id] = total + 1
        seconds = self.cost.step_time(BatchShape(prefill, attention, decodes, context))
        return ModelRunnerOutput(sampled_token_ids=sampled, execute_time=seconds)
