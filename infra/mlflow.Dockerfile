# MLflow tracking server with the Postgres (psycopg2) and S3 (boto3) drivers that the
# upstream image does not guarantee. Build from the repository root:
#   docker build -f infra/mlflow.Dockerfile -t memfit-mlflow:3.17.2 .
# Versions come from constraints.txt, so server and clients run the same mlflow.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    MLFLOW_DISABLE_TELEMETRY=true \
    DO_NOT_TRACK=true

COPY constraints.txt /tmp/constraints.txt
RUN pip install -c /tmp/constraints.txt "mlflow==3.17.2" "psycopg2-binary==2.9.13" boto3 \
    && rm /tmp/constraints.txt

RUN useradd --create-home --uid 1000 mlflow
USER mlflow
WORKDIR /home/mlflow
EXPOSE 5000
# docker-compose.yml passes the full `mlflow server ...` command line.
CMD ["mlflow", "server", "--host", "0.0.0.0", "--port", "5000"]
