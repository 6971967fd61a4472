"""Pure data and planning: the Graph, liveness and cut points, the chain model, schedules,
plans, budgets, the planners and the static allocator. Standard library and numpy only (scipy
inside the MILP solve); never torch, so plans can be made and checked anywhere."""
