"""gRPC serving for k3jax: `k3jax-serve` (serve/server.py), `k3jax-client` (serve/client.py), the
`k3jax.v1` interface (serve/proto/k3jax/v1/generation.proto, message classes in serve/pb.py) and
Prometheus metrics (serve/metrics.py). See docs/serving.md."""
