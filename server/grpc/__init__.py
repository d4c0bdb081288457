"""The gRPC front doors: the server (health, reflection, API keys, calls counted), KServe v2 /
Triton's inference service, vLLM's engine service, and Kiln's errors as status codes."""
