// Items cut into batch requests within the endpoint's limits (docs/api.md, "Limits"): at most 500 items
// and 1 MiB of JSON body. Each item is serialized once; a batch's body is those exact bytes.
export const MAX_BATCH_ITEMS = 500;
export const MAX_BATCH_BYTES = 1024 * 1024;
const OPEN = '{"conversions":[';
const CLOSE = "]}";
const encoder = new TextEncoder();
function utf8Length(text) {
    return encoder.encode(text).length;
}
/** Batches in input order, lazily, so a long iterable is never held whole. */
export function* batches(items, maxItems = MAX_BATCH_ITEMS, maxBytes = MAX_BATCH_BYTES) {
    if (!Number.isInteger(maxItems) || maxItems < 1 || maxItems > MAX_BATCH_ITEMS) {
        throw new RangeError(`batchSize must be 1 to ${MAX_BATCH_ITEMS}`);
    }
    const empty = utf8Length(OPEN) + utf8Length(CLOSE);
    let current = [];
    let offset = 0;
    let size = empty;
    const flush = () => {
        const batch = { kind: "batch", offset, items: current, body: OPEN + current.join(",") + CLOSE, bytes: size };
        current = [];
        size = empty;
        return batch;
    };
    let index = 0;
    for (const item of items) {
        const encoded = JSON.stringify(item);
        if (encoded === undefined)
            throw new TypeError(`item ${index} cannot be serialized as JSON`);
        const length = utf8Length(encoded);
        if (empty + length > maxBytes) {
            if (current.length > 0)
                yield flush();
            yield { kind: "oversized", index, bytes: length };
            index++;
            continue;
        }
        if (current.length > 0 && (size + length + 1 > maxBytes || current.length >= maxItems))
            yield flush();
        if (current.length === 0)
            offset = index;
        size += length + (current.length > 0 ? 1 : 0);
        current.push(encoded);
        index++;
    }
    if (current.length > 0)
        yield flush();
}
