"""Replay the deep pair on a trace recorded on this box, priced at its own steps (``recorded_cost_model``, as the
built-in ``deep-cpu`` case): ``python intel_case.py TRACE_DIR OUT_DIR``."""

import sys
from pathlib import Path

import torch

from dcut.replay.cases import CPU_HOST, SIZES, load_traces, recorded_cost_model
from dcut.replay.host import HostWork
from dcut.replay.report import Case
from dcut.replay.write import write_report

torch.set_num_threads(1)  # as dcut replay: tiny tensors, and the figures cannot depend on it
trace_dir = Path(sys.argv[1])
case = Case("deep-intel", load_traces(trace_dir), recorded_cost_model(trace_dir, HostWork.load(CPU_HOST)), SIZES,
            "deep pair, recorded on the Intel box; its costs")
write_report([case], Path(sys.argv[2]), 400, 100, 5)
