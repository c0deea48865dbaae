-- Visits are recorded by the site tracking script, outside this API; the project owns the schema.
CREATE TABLE visits (
    id           bigserial PRIMARY KEY,
    workspace_id text NOT NULL REFERENCES workspaces (id),
    -- The 16-character svc_vid id.
    visitor_id   text,
    click_id     text,
    -- svc_r on per-recipient links; matched against a conversion's contact_id.
    recipient_id text,
    visited_at   timestamptz NOT NULL,
    page         text
);
CREATE INDEX visits_by_visitor ON visits (workspace_id, visitor_id, visited_at) WHERE visitor_id IS NOT NULL;
CREATE INDEX visits_by_click ON visits (workspace_id, click_id, visited_at) WHERE click_id IS NOT NULL;
CREATE INDEX visits_by_recipient ON visits (workspace_id, recipient_id, visited_at) WHERE recipient_id IS NOT NULL;

-- A conversion's visits, and what matched them. Recomputed whenever the conversion is written.
CREATE TABLE conversion_matches (
    conversion_id text NOT NULL REFERENCES conversions (id),
    visit_id      bigint NOT NULL REFERENCES visits (id) ON DELETE CASCADE,
    matched_by    text NOT NULL CHECK (matched_by IN ('visitor_id', 'click_id', 'contact_id')),
    matched_at    timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (conversion_id, visit_id, matched_by)
);
CREATE INDEX conversion_matches_by_visit ON conversion_matches (visit_id);

-- One row per erasure; never the identifier itself.
CREATE TABLE erasures (
    id               bigserial PRIMARY KEY,
    workspace_id     text NOT NULL REFERENCES workspaces (id),
    identifier_kind  text NOT NULL CHECK (identifier_kind IN ('email', 'phone', 'contact_id', 'visitor_id')),
    conversions      integer NOT NULL,
    visits           integer NOT NULL,
    erased_at        timestamptz NOT NULL DEFAULT now()
);
