# The jobfence image: workers, beats and flower all run from it (see docker-compose.yml).
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app
COPY pyproject.toml README.md LICENSE ./
COPY config ./config
COPY locks ./locks
COPY tasks ./tasks
COPY worker ./worker
COPY jobfence ./jobfence
# The ledger is PostgreSQL; Redis (locks, broker, results) is in the core; Flower for its UI.
RUN pip install ".[postgres,flower]" \
    && useradd --create-home --uid 10001 jobfence
# The demo shop the services run (celery -A demo.app): an example beside the install, not in
# the wheel (demo/ of the repository).
COPY demo /opt/jobfence-demo/demo
ENV PYTHONPATH=/opt/jobfence-demo
USER jobfence

# Celery's warm shutdown on SIGTERM lets running jobs finish; give it time in compose.
STOPSIGNAL SIGTERM
CMD ["celery", "-A", "demo.app", "worker", "--loglevel=INFO"]
