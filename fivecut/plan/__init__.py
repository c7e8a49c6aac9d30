"""The planner: what a layout costs in memory, communication and time, before launch."""
