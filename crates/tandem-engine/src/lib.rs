//! Slots, continuous batching, prompt cache and sampling. Filled in by the serve issue.
