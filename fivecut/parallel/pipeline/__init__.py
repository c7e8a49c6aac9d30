"""Pipeline parallelism: the layers cut into stages, the batch into microbatches.

schedule.py   schedules as data: per-rank action lists (F, B, W, sends, receives); where each
              message is posted (`posting`: NCCL's order, a bounded window) and the checks
streams.py    NCCL's semantics as a model: each rank's batches on one stream, in posting order
simulate.py   the same lists timed with per-action costs: timelines, bubble, in-flight counts
draw.py       Gantt charts of simulated timelines
split.py      balancing layers into stages, building a rank's stage modules
executor.py   running a rank's action list with torch.distributed point-to-point
wgrad.py      the zero-bubble split of backward: B keeps each linear layer's (x, dy), W computes dW
"""
