//! Model architectures and the forward pass over the Backend trait. Filled in by the inference issue.
