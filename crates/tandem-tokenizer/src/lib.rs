//! GGUF tokenizers and chat templates. Filled in by the text issue.
