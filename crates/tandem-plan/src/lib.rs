//! Placement planner: a pure function from GGUF headers, rules and budgets to a Placement.
//! Filled in by the placement-planner issue.
