import { IntakeClient, prehash } from "intake-client";

const client = new IntakeClient({ baseUrl: process.env.INTAKE_BASE_URL, apiKey: process.env.INTAKE_API_KEY });
console.log((await client.getWorkspace()).workspace.id); // verifies the key
const lead = { event: "lead", external_id: "crm-2001", occurred_at: "2025-06-01T09:30:00Z",
  email: "Ann@Example.com", phone: "+14155552671", country: "US" };
console.log((await client.send(prehash(lead))).result); // created; unchanged when sent again
const deals = [0, 1, 2].map((n) => ({ event: "signed", external_id: `deal-2001-${n}`, parent_external_id: "crm-2001",
  occurred_at: "2025-06-02T10:00:00Z", value: "990.00", currency: "USD" }));
console.log((await client.sendMany(deals)).summary); // batches of <= 500 items and 1 MiB, retried when safe
const check = await client.validate([{ ...deals[0], event: "not valid!" }]); // stores nothing
console.log(JSON.stringify(check.results[0]));
