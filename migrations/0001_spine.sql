-- Workspaces, keys, conversions and chains; the writer is the only program that writes here.

CREATE TABLE workspaces (
    id               text PRIMARY KEY,
    name             text NOT NULL,
    project_id       text NOT NULL,
    status           text NOT NULL DEFAULT 'active' CHECK (status IN ('active', 'suspended')),
    site_restriction text NOT NULL DEFAULT 'any' CHECK (site_restriction IN ('any', 'listed')),
    created_at       timestamptz NOT NULL DEFAULT now(),
    -- Deleted workspaces are kept (their data is not lost); their keys answer workspace_not_found.
    deleted_at       timestamptz
);

CREATE TABLE sites (
    workspace_id text NOT NULL REFERENCES workspaces (id),
    host         text NOT NULL,
    last_seen_at timestamptz,
    PRIMARY KEY (workspace_id, host)
);

CREATE TABLE api_keys (
    id            text PRIMARY KEY,
    workspace_id  text NOT NULL REFERENCES workspaces (id),
    -- Only the SHA-256 of the secret is stored.
    secret_sha256 bytea NOT NULL UNIQUE,
    scopes        text[] NOT NULL,
    created_at    timestamptz NOT NULL DEFAULT now(),
    revoked_at    timestamptz
);

-- A journey. Chains only merge: a merged chain points at the chain it went into, so an old
-- chain id can always be resolved.
CREATE TABLE chains (
    id           text PRIMARY KEY,
    workspace_id text NOT NULL REFERENCES workspaces (id),
    created_at   timestamptz NOT NULL DEFAULT clock_timestamp(),
    merged_into  text REFERENCES chains (id),
    merged_at    timestamptz
);
CREATE INDEX chains_merged_into ON chains (merged_into) WHERE merged_into IS NOT NULL;

CREATE TABLE conversions (
    id                 text PRIMARY KEY,
    workspace_id       text NOT NULL REFERENCES workspaces (id),
    event              text NOT NULL,
    external_id        text NOT NULL,
    parent_external_id text,
    chain_id           text NOT NULL REFERENCES chains (id),
    occurred_at        timestamptz NOT NULL,
    visitor_id         text,
    click_id           text,
    contact_id         text,
    email_sha256       text,
    phone_sha256       text,
    address_sha256     text,
    country            text,
    value              numeric,
    currency           text,
    hdyhau             text,
    tags               jsonb,
    created_at         timestamptz NOT NULL DEFAULT now(),
    updated_at         timestamptz NOT NULL DEFAULT now(),
    UNIQUE (workspace_id, event, external_id)
);
CREATE INDEX conversions_by_external_id ON conversions (workspace_id, external_id);
CREATE INDEX conversions_by_parent ON conversions (workspace_id, parent_external_id)
    WHERE parent_external_id IS NOT NULL;
CREATE INDEX conversions_by_chain ON conversions (workspace_id, chain_id);

-- Request messages already applied, with their results: a redelivered or replayed message is
-- answered with its first outcome instead of being applied again. Pruned after the topic's
-- retention.
CREATE TABLE applied_messages (
    correlation_id text PRIMARY KEY,
    workspace_id   text NOT NULL,
    results        jsonb NOT NULL,
    applied_at     timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX applied_messages_by_age ON applied_messages (applied_at);
