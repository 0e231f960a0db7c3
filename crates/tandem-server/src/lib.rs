//! gRPC and HTTP front ends over the engine. Filled in by the serve and HTTP issues.
