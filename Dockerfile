# maingrad service: `maingrad serve` on an embedded SQLite file in /data by default.
#   docker build -t maingrad .
#   docker run -p 8000:8000 -v maingrad-data:/data maingrad
# PostgreSQL instead: -e MAINGRAD_DATABASE_URL=postgresql+psycopg://user:pass@host:5432/maingrad
# (see docs/service.md). Set MAINGRAD_SECRET (token hashing key) and MAINGRAD_ADMIN_TOKEN in production.
# The base image is pinned by digest (a tag moves under you); re-resolve it when bumping with
#   docker buildx imagetools inspect python:3.12-slim
FROM python:3.12-slim@sha256:78387bc3881b8273120a12ebe6c1ab22b018ccc2c9adf565ae1ac9b536e184ea

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /build
COPY pyproject.toml README.md constraints.txt ./
COPY contracts ./contracts
COPY analyzer ./analyzer
COPY cli ./cli
COPY hooks ./hooks
COPY service ./service
# The exact versions the test suite runs with (constraints.txt), not whatever is newest on the day of the build.
RUN pip install -c constraints.txt ".[service]" && rm -rf /build

RUN useradd --system --uid 10001 --user-group --home-dir /data --create-home maingrad
USER maingrad
WORKDIR /data
ENV MAINGRAD_DATABASE_URL=sqlite:////data/maingrad.db \
    MAINGRAD_SECRET_FILE=/data/maingrad.secret
VOLUME ["/data"]
EXPOSE 8000

HEALTHCHECK --interval=30s --timeout=5s --start-period=30s --retries=3 \
    CMD ["python", "-c", "import sys, urllib.request; sys.exit(urllib.request.urlopen('http://127.0.0.1:8000/healthz', timeout=4).status != 200)"]

CMD ["maingrad", "serve", "--host", "0.0.0.0", "--port", "8000"]
