import os
from intake_client import IntakeClient, prehash

client = IntakeClient(os.environ["INTAKE_BASE_URL"], os.environ["INTAKE_API_KEY"])
print(client.get_workspace()["workspace"]["id"])  # verifies the key
lead = {"event": "lead", "external_id": "crm-1001", "occurred_at": "2025-06-01T09:30:00Z",
        "email": "Ann@Example.com", "phone": "+14155552671", "country": "US"}
print(client.send(prehash(lead)).result)  # created; unchanged when sent again
deals = [{"event": "signed", "external_id": f"deal-1001-{n}", "parent_external_id": "crm-1001",
          "occurred_at": "2025-06-02T10:00:00Z", "value": "990.00", "currency": "USD"} for n in range(3)]
print(client.send_many(deals).summary)  # batches of <= 500 items and 1 MiB, retried when safe
print(client.validate([{**deals[0], "event": "not valid!"}]).results[0].error)  # stores nothing
