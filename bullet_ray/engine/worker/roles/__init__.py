"""The three worker roles: prefill (bullet), decode (bullet), hybrid (chunked baseline).

Each role plans its batches and turns collected steps into messages; `WorkerBase.step` launches and
collects them (asynchronously when the config says so: the host learns a step's tokens one step late).

Progress on a full KV pool (bullet). Blocks are held by the decode worker's running sequences (they grow, or
the youngest is preempted to the prefill queue's front with its blocks freed: they never wait), by steps in
flight and sequences in transit (they soon free or pass them on), and by prompts prefilled part-way, which
hold theirs while they wait for their next chunk. A queue of such prompts moves once every block in use is
its own (`PrefillScheduler`: its head takes the watermark and the KV of prompts behind it). Under the mixed
fallback there are two such queues, the prefill worker's and the decode worker's handed-over `prompts`, and
each could hold a prompt part-way and wait for the other's blocks forever. So at most one of them may: the
prefill worker plans nothing while the decode worker still holds (or is being sent) prompts the fallback
handed it (`StateBlock.num_handed_prompts_held`, exact from the prefill side's view or above the truth, never
below). A hand-over empties the prefill queue, and the prefill queue takes blocks only while that count is 0,
so whenever the decode side's `prompts` hold blocks the prefill queue holds none, and the one queue that
holds part-way prompts moves by its own rule. The decode side's `prompts` take only those hand-overs;
prefilled sequences join its running set.

The package: `side.py` (what the roles share and `SideWorker`), `prefill.py`, `decode.py`, `hybrid.py`.
"""

from bullet_ray.engine.worker.roles.decode import DecodeWorker
from bullet_ray.engine.worker.roles.hybrid import HybridWorker
from bullet_ray.engine.worker.roles.prefill import PLAN_WAIT_POLL_S, PrefillWorker
from bullet_ray.engine.worker.roles.side import SideWorker, sequence_from_request

__all__ = ["PLAN_WAIT_POLL_S", "DecodeWorker", "HybridWorker", "PrefillWorker", "SideWorker", "sequence_from_request"]
