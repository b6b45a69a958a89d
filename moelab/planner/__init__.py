"""The analytic planner, torch-free: parameters and FLOPs (flops), per-layer shapes (shapes), the pipeline's
stage split (stages), memory / communication / a fits verdict per GPU (plan, FSDP2's traffic in comm, the pipeline
schedules in schedule, the expert exchange's rows per token in dispatch), what to change when it does not fit
(fixes), and with a GPU kind (gpus) the predicted step time and throughput (speed, at the measured kernel rates
and published fabric rates of rates).

    from moelab.planner.plan import plan
    plan(load_config("qwen3-moe-30b-a3b"), gpus=8)
"""
