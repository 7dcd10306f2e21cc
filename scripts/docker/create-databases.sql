-- The meta server's own database, beside the shop's (docker-compose.yml); run once by the postgres
-- image when its volume is new.
CREATE DATABASE qmq_meta OWNER qmq;
