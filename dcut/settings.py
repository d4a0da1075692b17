"""One tree of validated D-Cut settings, shared by the CLI, the vLLM plugin and the deployments."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from dcut.specexit import SpecExitSettings

Mode = Literal["full", "fixed", "reference", "continuous", "per_request", "joint"]
ZeroWidth = Literal["catch_up", "vllm"]
# Old mode names, refused with the new one named (no silent alias): a config written for the old name says so.
RENAMED_MODES = {"auto": "reference"}


def renamed_mode(name: object) -> str | None:
    """Why ``name`` is no longer a mode (it was renamed), or None."""
    new = RENAMED_MODES.get(name) if isinstance(name, str) else None
    return None if new is None else (f"mode {name!r} was renamed to {new!r} (the reference paper's rule: keep "
                                     f"ratio 25/50/75/100% chosen by U); write mode: {new}")


class DCutSettings(BaseModel):
    """How D-Cut decides, per engine step, how many drafts to verify.

    Given to vLLM as ``additional_config={"dcut": {...}}``.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    mode: Mode = Field("joint", description="joint (the default, what every config ships): choose the drafted "
                       "width each step, then the verify budget (dcut.width); full: verify every draft (D-Cut "
                       "counts, cuts nothing); fixed: a global keep ratio; reference: the reference paper's rule, "
                       "keep ratio 25/50/75/100% chosen by U = sum of top-k scores / C(bs, bs+k) (formerly auto); "
                       "continuous: any budget on the measured cost staircase; per_request: the same number of "
                       "drafts for every request (a comparison point).")
    fixed_ratio: float = Field(0.5, gt=0.0, le=1.0, description="Keep ratio used by mode=fixed.")
    per_request_depth: int = Field(4, ge=0, description="Drafts kept per request by mode=per_request.")
    count_bonus: bool = Field(True, description="Count the bs bonus tokens in U's numerator: U is then "
                              "expected tokens per step over step cost, so 'verify no drafts' is a "
                              "candidate and wins when drafts do not pay. The reference implementation: False.")
    fallback_ratio: float = Field(0.75, gt=0.0, le=1.0,
                                  description="Keep ratio when no cost covers this batch size.")
    min_budget: int = Field(0, ge=0, description="Floor on drafts kept across the batch.")
    min_saving: float = Field(0.0, ge=0.0, lt=1.0,
                              description="Keep full width unless the chosen budget saves at least "
                              "this fraction of the full-width cost (compaction is not free).")
    calibrate: bool = Field(True, description="Map raw confidence to observed acceptance per position, "
                            "learned online from verification (raw DFlash confidences can be far off: ECE "
                            "0.48-0.69 past position 3 for the Dense pair's drafter, 0.03-0.23 for the deep pair's).")
    context_cost: bool = Field(True, description="Price every deciding verify cost at the batch's mean context "
                               "(the cost table's context axis, dcut.context_cost); False: at the profiled context.")
    default_max_width: int | None = Field(None, ge=0, description="Drafts per step a request may be given "
                                          "when it does not say (its `speculation` field, dcut.speculation): "
                                          "None: K; 0: requests decode plainly unless they ask for speculation.")
    # Width control (mode=joint)
    widths: list[int] | None = Field(None, description="Drafted widths mode=joint may choose (default "
                                     "0,1,2,3,5,7,11,15 capped at K, with K; given: exactly those <= K, "
                                     "so [0] pins width 0).")
    width_hysteresis: float = Field(0.02, ge=0.0, description="Keep the current width unless another is "
                                    "estimated this much faster.")
    speed_shift: float | None = Field(
        0.3, gt=0.0, description="Mode joint: when a run of a width's cycles (dcut.width.realized.SHIFT_RUN) all took "
        "this much more (or less) time than its mean, relative to the cost table, the machine changed speed: the batch "
        "size's other widths, measured at the old speed, are measured again. None: never (a machine of one speed).")
    count_mixed_steps: bool = Field(
        False, description="Mode joint: a width's realized rate also counts the cycles whose verification step held "
        "prefills (new requests). Off: live it lost to pure steps alone at bs 32 "
        "(docs/experiments/2026-12-05-compare-mixed).")
    probe_share: float = Field(0.01, ge=0.0, lt=1.0, description="Share of step time spent on probe steps "
                               "(another width, verified in full) so acceptance stays known where D-Cut "
                               "does not draft or verify.")
    zero_width: ZeroWidth = Field("catch_up", description="How a width-0 step keeps the drafter in sync. "
                                  "catch_up (DFlash): keep the step's target hidden states and write the "
                                  "drafter's context K/V for them in one batch before the next drafting pass; "
                                  "vllm: vLLM's own K=0 path (the drafter's first pass every step).")
    # Cost table
    cost_table: str | None = Field(None, description="Path of a cost table JSON to use instead of profiling.")
    cache_dir: str | None = Field(None, description="Where profiled tables are cached by fingerprint "
                                  "(default ~/.cache/dcut).")
    learned: str | None = Field(None, description="Mode joint: path of a learned-state JSON (dcut.learned, what "
                                "other replicas of the same fingerprint learned) to start from instead of cold.")
    profile: bool = Field(True, description="Profile a cost table at engine start when none is given.")
    profile_batch_sizes: list[int] | None = Field(
        None, description="Batch sizes to profile (default: powers of two up to max_num_seqs).")
    profile_context_len: int = Field(128, ge=1, description="Context length of the dummy profiling requests.")
    profile_context_lens: list[int] | None = Field(
        None, description="Context lengths at which verify steps are also profiled, for how their cost grows with "
        "context (dcut.context_cost): full width at each, a plain step at the longest. Default: about max_model_len/4 "
        "and /2 and max_model_len - K - 2; [] profiles none (verify costs then ignore context).")
    profile_warmups: int = Field(2, ge=0)
    profile_repeats: int = Field(3, ge=1)
    refine: bool = Field(True, description="Refine the cost table from timed live steps.")
    stats_window: int = Field(512, ge=1, description="How many recent steps the stats ring keeps.")
    # Recording (dcut.trace)
    trace: str | None = Field(None, description="Record a replay trace into this folder (dcut.trace): every "
                              "draft is verified, so each request's true accepted length is known; the drafted "
                              "width rotates over trace_widths, one per step. A measurement mode: it decides nothing.")
    trace_widths: list[int] = Field([1, 3, 7, 15], description="Widths a trace rotates over (those <= K).")

    @field_validator("mode", mode="before")
    @classmethod
    def _renamed_mode(cls, value: object) -> object:
        if (why := renamed_mode(value)) is not None:
            raise ValueError(why)
        return value

    @model_validator(mode="after")
    def _sizes_positive(self) -> DCutSettings:
        if self.profile_batch_sizes is not None and any(b < 1 for b in self.profile_batch_sizes):
            raise ValueError("profile_batch_sizes must all be >= 1")
        if self.profile_context_lens is not None and any(c < 1 for c in self.profile_context_lens):
            raise ValueError("profile_context_lens must all be >= 1")
        if self.widths is not None and (not self.widths or any(w < 0 for w in self.widths)):
            raise ValueError("widths must be a non-empty list of integers >= 0")
        if not self.trace_widths or any(w < 1 for w in self.trace_widths):
            raise ValueError("trace_widths must be a non-empty list of integers >= 1")
        return self


SpecMethod = Literal["none", "dflash", "draft_model"]


def engine_env(tensor_parallel_size: int = 1, kv_cache_gib: int = 2) -> dict[str, str]:
    """vLLM's environment on a small CPU box, in one place: nothing from a model hub, no usage stats, a
    ``kv_cache_gib`` KV cache (vLLM's CPU default reserves ~92% of RAM, so two engines could not coexist)
    and, at TP=1, the engine in-process (it starts in seconds).

    No AOT compile: on CPU, vLLM 0.32 compiles without Inductor, and an AOT artifact saved that way never
    loads again ("Compiling model again due to a load failure ...: 'function' object has no attribute
    'finalize_loading'"), so every engine start traced, saved a new artifact and threw it away (~15 s of the
    deep pair's start). Without it Dynamo traces the graph in a few seconds and the engine runs the same
    eager graph."""
    env = {"HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
           "VLLM_USE_AOT_COMPILE": "0"}
    if tensor_parallel_size == 1:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    return env

EMBEDDED_MODELS = {
    "dense": ("models/dense", "models/dense-dflash"),
    "deep": ("models/deep", "models/deep-dflash"),
    "moe": ("models/moe", "models/moe-dflash"),
    "reasoning": ("models/reasoning", "models/reasoning-dflash"),  # thinks, then answers: SpecExit's pair
}
DEFAULT_PAIR = "deep"  # in D-Cut's regime (models/deep/README.md, "Cost regime")


class EngineSettings(BaseModel):
    """Everything needed to build a vLLM engine with (or without) D-Cut; one place for defaults."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(EMBEDDED_MODELS[DEFAULT_PAIR][0], description="Target model folder (local path).")
    draft: str | None = Field(EMBEDDED_MODELS[DEFAULT_PAIR][1], description="Drafter folder; None: no speculation.")
    method: SpecMethod = Field("dflash", description="Speculative method; 'none': no speculation (no drafter).")
    num_speculative_tokens: int = Field(15, ge=1, le=64, description="K, drafts per request per step.")
    spec_schedule: list[tuple[int, int, int]] | None = Field(
        None, description="vLLM dynamic speculation: (bs from, bs to, K) ranges; K per batch size.")
    tensor_parallel_size: int = Field(1, ge=1)
    distributed_executor_backend: Literal["mp", "ray"] | None = Field(
        None, description="How vLLM runs its TP workers: None lets vLLM choose (mp on one node); 'ray' places them "
        "in the Serve replica's placement group (deployments.settings.EngineReplicaSettings.placement_group_bundles).")
    dtype: str = Field("float32", description="float32 on AVX2 CPUs (bf16 is 3-5x slower there).")
    max_num_seqs: int = Field(64, ge=1)
    max_model_len: int = Field(1024, ge=16)
    max_num_batched_tokens: int | None = Field(None, ge=16)
    prefix_caching: bool | None = Field(None, description="vLLM's automatic prefix caching (None: vLLM's default, "
                                        "on). The live benchmarks turn it off in every arm: their repeats re-send the "
                                        "same prompts, and vLLM 0.32's drafter engines (EAGLE family, DFlash) give up "
                                        "the last matched block of a hit, 128 tokens on CPU, so an engine without a "
                                        "drafter would prefill less for reasons that are not decoding.")
    async_scheduling: bool | None = Field(None, description="vLLM's asynchronous scheduling (None: vLLM's default, "
                                          "on for a GPU, off on CPU). A D-Cut or SpecExit engine runs synchronously "
                                          "whatever is set (D-Cut cuts drafts before the next schedule).")
    enforce_eager: bool = Field(False, description="vLLM's default: compiled. True runs eagerly (faster start).")
    gpu_memory_utilization: float | None = Field(
        None, gt=0.0, le=1.0, description="Share of the GPU this engine may take (None: vLLM's default, 0.9). "
        "Benchmarks that hold several engines on one GPU split it between them (dcut.memory). vLLM's CPU backend "
        "reads it as a share of host memory; the benchmarks leave it unset there.")
    seed: int = 0
    served_model_name: str | None = None
    dcut: DCutSettings | None = Field(default_factory=DCutSettings,
                                      description="D-Cut settings; None: D-Cut stays out of the engine (with "
                                      "method none, nothing to cut; with a drafter, vLLM's own speculation: every "
                                      "draft verified, no D-Cut figures). Verify everything with D-Cut counting: "
                                      "mode full.")
    specexit: SpecExitSettings | None = Field(None, description="SpecExit: end the thinking early from the "
                                              "drafter's signals (a reasoning pair with a signal head); None: off.")

    @property
    def with_dcut(self) -> bool:
        """D-Cut runs in the engine: it has settings and a drafter to cut (method none has nothing to cut)."""
        return self.dcut is not None and self.method != "none"
