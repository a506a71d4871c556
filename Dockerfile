# The relay's container image: a build stage compiles the release binary, the runtime
# stage is Debian slim with that one binary, run as a non-root user.
#
# The production binary leaves out the developer tools (`demo`, `bench`:
# --no-default-features), so the image carries no script and no plotting code.
# Every file the build reads must be COPYed below: `scripts/container-check`
# (run by CI) copies exactly these COPY sources into a clean directory and builds
# there, so a missing one fails CI rather than `docker build`.
#
# Configuration comes from the environment (OUTBOX_RELAY__SECTION__KEY, see
# docs/configuration.md); no config file is needed. To use one, mount it and pass
# `--config /path/relay.toml` (a named file that is missing is an error).

FROM rust:1-slim-bookworm AS build
# librdkafka is compiled from the sources bundled by rdkafka-sys: a C toolchain, make,
# python3 (its configure script), and the headers of zlib and OpenSSL (TLS, SASL SCRAM).
RUN apt-get update \
 && apt-get install -y --no-install-recommends build-essential pkg-config zlib1g-dev libssl-dev python3 \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
# The manifest, the code, the SQL that `migrate` embeds, and the benches: Cargo
# refuses a manifest whose declared bench is missing (the integration tests need the
# `tools` feature, so their absence is fine).
COPY Cargo.toml Cargo.lock ./
COPY src ./src
COPY migrations ./migrations
COPY benches ./benches
RUN cargo build --release --locked --no-default-features --bin outbox-relay

FROM debian:bookworm-slim AS runtime
# CA certificates for TLS to PostgreSQL and Kafka, and OpenSSL's libssl for Kafka's
# TLS and SASL (librdkafka links Debian's OpenSSL); libz is part of the slim base.
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates libssl3 \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --system --uid 10001 --user-group --no-create-home --shell /usr/sbin/nologin relay
COPY --from=build /src/target/release/outbox-relay /usr/local/bin/outbox-relay
USER 10001:10001
# The metrics and health endpoint (read-only, unauthenticated: publish it to the
# scraper and the orchestrator only). The health check below asks it.
ENV OUTBOX_RELAY__METRICS__LISTEN=0.0.0.0:9187 \
    OUTBOX_RELAY__LOG__FORMAT=json
EXPOSE 9187
# The image has no curl: the binary probes its own /healthz (exit 0 on 200, else 1).
HEALTHCHECK --interval=15s --timeout=5s --start-period=10s --retries=3 \
  CMD ["/usr/local/bin/outbox-relay", "health", "--addr", "127.0.0.1:9187"]
# SIGTERM (docker stop) drains in-flight events for up to relay.shutdown_timeout_secs
# (30 s): give `docker stop` a longer --time (or stop_grace_period) than that.
STOPSIGNAL SIGTERM
ENTRYPOINT ["/usr/local/bin/outbox-relay"]
CMD ["run"]
