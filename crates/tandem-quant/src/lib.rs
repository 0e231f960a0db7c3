//! ggml block formats.
