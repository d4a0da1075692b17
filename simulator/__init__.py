"""The autoscaler at scale, simulated: the real `DCutPolicy` under Ray Serve 2.60's control loop, with replicas
replayed from a committed cost table and acceptance curve (no engines, no Ray instance).

- `traces`: demand over time (step, ramp, diurnal, bursty).
- `serve`: Serve's side on a simulated clock: metric samples and pushes, the wrapper around a custom policy,
  the replicas it starts and stops.
- `run`: what a replica reports, one run of a trace, and its scores.
- `report`: summaries over a step's push phases, the bars a knob setting must pass, the choice, tables and plots.
- `__main__`: ``python -m simulator --out docs/experiments/2026-12-01-autoscaling``: every trace at every fleet size,
  the knob sweep, the chosen knobs.
"""
