# Multi-stage build of the release binary on a slim runtime image.
# librdkafka is compiled from the bundled sources by rdkafka-sys (needs a C toolchain,
# make, cmake-free); the runtime image needs only libc, zlib and CA certificates.
FROM rust:1-slim-bookworm AS build
RUN apt-get update \
 && apt-get install -y --no-install-recommends build-essential pkg-config zlib1g-dev python3 \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY Cargo.toml Cargo.lock ./
COPY src ./src
COPY migrations ./migrations
COPY benches ./benches
COPY tests ./tests
RUN cargo build --release --locked --bin outbox-relay

FROM debian:bookworm-slim
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates zlib1g \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --system --uid 10001 --no-create-home relay
COPY --from=build /src/target/release/outbox-relay /usr/local/bin/outbox-relay
COPY config/relay.example.toml /etc/outbox-relay/relay.toml
USER relay
ENTRYPOINT ["/usr/local/bin/outbox-relay"]
CMD ["run", "--config", "/etc/outbox-relay/relay.toml"]
