"""Other engines' speculation rules as replay policies: the anchors dcut-serve is judged against.

Each class re-implements one engine's decision rule, read from that engine's source (cited per
class, with the commit read where the index gave one), on replay's interface
(``dcut.replay.policy``), so that replay prices it on the same trace and cost model as dcut's own
policies. Where the rule had to be adapted to replay (no request identity across steps, a cost
model instead of the engine's own profile), the class says how and why.

One module per engine's rule: ``vllm_adaptive``, ``sglang_adaptive``, ``trtllm_schedule``.
"""

from dcut.replay.anchors.sglang_adaptive import SGLANG_BS_AWARE_SLOTS, SGLangAdaptive, SGLangSlot
from dcut.replay.anchors.trtllm_schedule import TRTLLMSchedule
from dcut.replay.anchors.vllm_adaptive import VLLMAdaptive

__all__ = ["SGLANG_BS_AWARE_SLOTS", "SGLangAdaptive", "SGLangSlot", "TRTLLMSchedule", "VLLMAdaptive"]
