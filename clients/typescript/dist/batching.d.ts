export declare const MAX_BATCH_ITEMS = 500;
export declare const MAX_BATCH_BYTES: number;
export interface Batch {
    kind: "batch";
    /** Index in the whole input of the batch's first item. */
    offset: number;
    items: string[];
    body: string;
    bytes: number;
}
/** An item that alone makes a body over the limit: it is answered without being sent. */
export interface Oversized {
    kind: "oversized";
    index: number;
    bytes: number;
}
/** Batches in input order, lazily, so a long iterable is never held whole. */
export declare function batches(items: Iterable<unknown>, maxItems?: number, maxBytes?: number): Generator<Batch | Oversized>;
