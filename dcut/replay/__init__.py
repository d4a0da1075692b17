"""Replay: judge decision policies on recorded (or synthetic) traces against a cost model, without noise.

A trace (``dcut.trace``) holds, per drafted width, what the drafter proposed (each position's
confidence) and what full verification accepted. Replay steps a simulated batch through it: each
policy chooses a width and keep depths, the true acceptance of what it kept is read off the trace,
and a cost model (``dcut.replay.costs``) prices the step. Same input, same output, every run.
"""
