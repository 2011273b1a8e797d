-- Runs once, on the first start of an empty postgres volume (docker-entrypoint-initdb.d),
-- as POSTGRES_USER, which then owns both databases.
-- One database per service: Prefect's and MLflow's migrations must not share a schema.
CREATE DATABASE prefect;
CREATE DATABASE mlflow;
